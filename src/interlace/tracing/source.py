"""Reading the source of a call site: files, IPython/Jupyter cells, `python -c`.

Each source is read ONCE per filename and kept in `SOURCES` for the life of the process; it
is not re-validated on later traces (a stat per trace would cost more than the whole warm
trace). If a file is edited while the process runs, the running code objects still match the
text read first; a call site whose code is newer than that text (a reloaded module) no longer
finds its `with` and the error says the file may have changed since it was first read.

Where a source comes from:
- files and anything else `linecache` knows (zip imports through the module's loader,
  IPython/Jupyter cells, which IPython registers in `linecache.cache`);
- `python -c CODE`: the code object's filename is "<string>"; the text is `sys.orig_argv`'s
  argument after `-c`, used only for code running in `__main__` (an `exec` of some other
  string is also named "<string>" and has no readable source);
- stdin, `exec` of a string, `compile()` with a made-up name: no source (`None`).
"""

from __future__ import annotations

import linecache
import sys

# filename -> tuple of lines (each with its line ending), or None when unreadable.
SOURCES: dict[str, tuple[str, ...] | None] = {}


def lines(filename: str, module_globals: dict | None = None) -> tuple[str, ...] | None:
    """The lines of `filename` (read once, then cached), or None when it cannot be read."""
    try:
        return SOURCES[filename]
    except KeyError:
        pass
    text = _read(filename, module_globals)
    # setdefault: two threads capturing at once agree on one copy.
    return SOURCES.setdefault(filename, text)


def _read(filename: str, module_globals: dict | None) -> tuple[str, ...] | None:
    if filename == "<string>":
        return _command_line_source(module_globals)
    # Drop a stale linecache entry for a file on disk (entries registered by IPython or a
    # loader have no mtime and are kept by checkcache).
    linecache.checkcache(filename)
    found = linecache.getlines(filename, module_globals)
    return tuple(found) if found else None


def _command_line_source(module_globals: dict | None) -> tuple[str, ...] | None:
    """The code given with `python -c`, if this "<string>" code runs in `__main__`."""
    main = sys.modules.get("__main__")
    if main is None or module_globals is not getattr(main, "__dict__", None):
        return None
    argv = list(getattr(sys, "orig_argv", None) or [])
    # The interpreter's own options come before -c; "-c" is the first such argument.
    if "-c" in argv[:-1]:
        return tuple(argv[argv.index("-c") + 1].splitlines(keepends=True))
    return None
