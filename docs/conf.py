"""Sphinx configuration of the kernapprox documentation (``make docs``: warnings are errors)."""

from __future__ import annotations

import importlib
import pkgutil
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
exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]
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

# Every cross-reference must resolve, except to what is deliberately not documented: private names (base classes
# in "Bases:", private helpers named in prose), module-level constants, and other projects' objects (no
# intersphinx: the build runs offline).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(.*\.)?_\w+"),
    (r"py:.*", r"(torch|numpy|np|scipy|sklearn|xarray|xr|matplotlib|dask|pandas|transformers)(\..*)?"),
    (r"py:data", r".*"),
    (r"py:attr", r"default_dim"),
]



def _private_reexports(package) -> dict[str, list[str]]:
    """Public names a package defines in a private submodule (``kernapprox.sweep.Experiment`` lives in
    ``kernapprox.sweep._experiment``): autosummary lists only a module's own members, so the module template
    lists these too. Names re-exported from public modules are documented there, once."""
    out = {}
    names = [package.__name__] + [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
                                  if not any(part.startswith("_") for part in info.name.split("."))]
    for name in names:
        module = importlib.import_module(name)
        found = [attr for attr in getattr(module, "__all__", ())
                 if getattr(getattr(module, attr), "__module__", "").startswith(name + "._")]
        if found:
            out[name] = found
    return out


autosummary_context = {"private_reexports": _private_reexports(kernapprox)}

html_theme = "pydata_sphinx_theme"
html_title = "kernapprox"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_show_sourcelink = False


# Cross-references to re-exported names (``kernapprox.linear_attention``, ``FeatureMap`` inside
# ``kernapprox.estimators``) point to the one page that documents the object, in the module that defines it.
def _lookup(name: str):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _resolve_reexport(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:  # relative to the current class, module, then each enclosing package
        candidates += [f"{module}.{cls}.{target}"] if cls else []
        parts = module.split(".")
        candidates += [".".join(parts[:cut] + [target]) for cut in range(len(parts), 0, -1)]
    candidates.append(f"kernapprox.{target}")  # pages outside any module (the API overview)
    for name in candidates:
        if not name.startswith("kernapprox"):
            continue
        obj = _lookup(name)
        qualname, defined_in = getattr(obj, "__qualname__", None), getattr(obj, "__module__", None)
        if obj is None or not qualname or not defined_in:
            continue
        canonical = f"{defined_in}.{qualname}"
        if canonical != target:
            found = env.domains["py"].resolve_xref(env, node["refdoc"], app.builder, node["reftype"], canonical, node,
                                                   contnode)
            if found is not None:
                return found
    return None


def setup(app):
    app.connect("missing-reference", _resolve_reexport)
