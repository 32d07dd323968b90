"""What type checkers see of domainpar (issue 19), checked on the source.

mypy itself runs as the `types` stage of `make test` (settings in pyproject's
[tool.mypy]). Here, serial and without importing torch: the names that
``domainpar/__init__.py`` loads lazily through ``__getattr__`` are also imported
under ``if TYPE_CHECKING:`` from the same modules (a type checker cannot follow
``importlib``), and the PEP 561 marker ``py.typed`` is there and ships.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INIT = ROOT / "domainpar" / "__init__.py"


def _module_tree() -> ast.Module:
    return ast.parse(INIT.read_text())


def _literal(tree: ast.Module, name: str) -> object:
    """The value of the module-level literal assignment ``name = ...``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"domainpar/__init__.py assigns no {name}")


def _type_checking_imports(tree: ast.Module) -> dict[str, str]:
    """``{name: module below domainpar}`` imported under ``if TYPE_CHECKING:``
    (a submodule imported as ``from . import m`` maps to itself)."""
    found: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING"):
            continue
        for imp in node.body:
            assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.unparse(imp)
            for alias in imp.names:
                assert alias.asname in (None, alias.name), ast.unparse(imp)
                found[alias.name] = imp.module or alias.name
    return found


def test_lazy_names_are_imported_for_type_checkers():
    tree = _module_tree()
    lazy_names = _literal(tree, "_TORCH_NAMES")
    lazy_modules = _literal(tree, "_TORCH_MODULES")
    expected = dict(lazy_names) | {m: m for m in lazy_modules}
    assert _type_checking_imports(tree) == expected


def test_every_public_name_is_visible_statically():
    tree = _module_tree()
    static = set(_type_checking_imports(tree))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            static |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign):
            static |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    missing = set(_literal(tree, "__all__")) - static
    assert not missing, f"__all__ names a type checker cannot see: {sorted(missing)}"


def test_py_typed_marker_ships():
    tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11's tomllib")
    assert (ROOT / "domainpar" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["domainpar"]
