"""Sphinx configuration of the jax_flash documentation (MyST Markdown pages, API pages from
the docstrings). Build: `sphinx-build -W --keep-going docs docs/_build/html` from the
repository root (tests/tooling/test_docs.py builds it this way)."""

import os
import sys

# The package is imported from the source tree (an editable install puts it there too).
sys.path.insert(0, os.path.abspath(".."))

import jax_flash

project = "jax_flash"
author = "jax_flash contributors"
copyright = "jax_flash contributors"
release = jax_flash.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: anchors for headings up to ### (links like [Dropout](attention.md#dropout)),
# $...$ math, definition lists.
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath", "deflist", "colon_fence"]

# Docstrings write code as `name` (Markdown habit): render it as inline code.
default_role = "code"
autodoc_member_order = "bysource"
# The docstrings state each argument's type and shape in words; the annotations (unions of
# array-likes, one overload per `return_residual`) would bury them. "none" also documents an
# overloaded function once, with its implementation's signature.
autodoc_typehints = "none"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"jax_flash {release}"
html_static_path = ["_static"]
html_theme_options = {"navigation_with_keys": True}
