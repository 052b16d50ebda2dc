"""Sphinx configuration: ``sphinx-build -W --keep-going -b html docs docs/_build/html``."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # the source tree, not an installed copy

import per_sample_hooks  # noqa: E402

project = "per_sample_hooks"
copyright = "the per_sample_hooks authors, MIT License"
release = version = per_sample_hooks.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_theme_options = {"description": "per-sample gradients, norms, DP clipping and curvature "
                                     "from hooks", "fixed_sidebar": True}
