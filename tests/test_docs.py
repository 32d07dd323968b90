"""The docs site's sources: the API reference covers the public face, and the
README's links into docs/ lead somewhere. (`make test`'s `docs` stage builds the
site itself with warnings as errors; these checks cover what Sphinx cannot see.)
"""
import re
from pathlib import Path

import domainpar

ROOT = Path(__file__).resolve().parent.parent


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_api_reference_documents_every_public_name():
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\.\. auto\w+:: domainpar\.(\w+)$", api, re.M))
    public = {n for n in domainpar.__all__ if not n.startswith("__")}
    assert public - documented == set(), "add these to docs/api.md"


def test_readme_links_into_docs_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) >= 10, links  # the README's table of docs pages
    broken = []
    for path, anchor in links:
        page = ROOT / path
        if not page.is_file() or (anchor and anchor not in _anchors(page)):
            broken.append(f"{path}#{anchor}" if anchor else path)
    assert not broken, f"README links to missing docs pages or sections: {broken}"


def test_slug_follows_github():
    assert _slug("The main job: `make demo`") == "the-main-job-make-demo"
    assert _slug("Planning memory: `domainpar plan`") == "planning-memory-domainpar-plan"
