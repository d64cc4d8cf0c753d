"""The command that installs one of setup.py's optional extras.

A command that needs a missing extra names it: the Makefile's own install (the
venv's pip, the exact versions of constraints.txt), run from the repository root.
"""

# The Makefile's INSTALL, less its --quiet (tests/test_papercuts.py compares them).
PIP_INSTALL = '.venv/bin/python -m pip install -c constraints.txt -e'


def install_hint(extra: str) -> str:
  """``.venv/bin/python -m pip install -c constraints.txt -e '.[extra]'``."""
  return f"{PIP_INSTALL} '.[{extra}]'"
