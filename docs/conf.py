"""Sphinx configuration: `make docs` builds the site into build/docs, and
`make test` builds it with warnings as errors (stage `docs`).

Pages are Markdown (myst-parser); the API reference comes from the public
names' docstrings (autodoc, numpydoc sections). The op table in ops.md is
generated from the dispatch table (`domainpar ops --write docs/ops.md`), and
tests/test_op_table.py keeps it current.
"""
import sys
from pathlib import Path

# Document the checkout being built, not whichever domainpar is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

project = "domainpar"
author = "the domainpar developers"
copyright = "the domainpar developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "numpydoc"]
# .rst only because numpydoc loads autosummary, which asks for it; the pages
# are all Markdown.
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# `## A heading` gets the anchor `#a-heading`, as on GitHub, so pages link to
# each other's sections (`design.md#adjoint-pairs`).
myst_heading_anchors = 3

# The public face's docstrings open with their MPI semantics ("Collective.",
# "Local."); numpydoc renders their Parameters/Returns sections. Members are
# listed where api.md asks for them, so the class pages stay the public ones.
autodoc_member_order = "bysource"
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

html_theme = "furo"
html_title = "domainpar"

# Every documented name must say what each parameter is and what it returns,
# in numpydoc sections (PR01 parameters missing, PR02 unknown, PR03 out of
# order, PR10 "name: type" without a space, RT01 no Returns section where
# something is returned). -W makes a miss an error in `make test`.
numpydoc_validation_checks = {"PR01", "PR02", "PR03", "PR10", "RT01"}
