"""Sphinx configuration of the kernapprox documentation (``make docs``: warnings are errors)."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The checkout's own package first (as the tests do), then this folder for the page generator.
sys.path[:0] = [str(ROOT), str(DOCS)]

from generate import write_generated  # noqa: E402

import kernapprox  # noqa: E402

# Generated at every build, never pasted: the estimator table (from the registry) and the figure gallery (from
# figures/*.png, their captions and texts).
write_generated(DOCS / "_generated")

project = "kernapprox"
author = "the kernapprox authors"
copyright = "the kernapprox authors"
release = version = kernapprox.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "_figure_notes", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# MyST: $…$ and $$…$$ maths, ``{figure}`` and friends, anchors for headings down to ###.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# API reference: one page per public object, generated from the docstrings.
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "inherited-members": False, "show-inheritance": True}
autodoc_typehints = "none"  # numpydoc's Parameters sections say the types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_validation_checks: set[str] = set()

html_theme = "pydata_sphinx_theme"
html_title = "kernapprox"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_show_sourcelink = False
