"""The interlace demo: `python -m demo` (see demo/__main__.py)."""
