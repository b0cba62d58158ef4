"""Reading the source of a call site: files, IPython/Jupyter cells, `python -c`.

Each source is read ONCE per filename and kept in `SOURCES` (a file on disk for the life of the
process; other texts, such as notebook cells, among the latest `TEXTS_LIMIT`); it is not
re-validated on later traces (a stat per trace would cost more than the whole warm trace). If a file is edited while the process runs, the running code objects still match the
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

import sys
import threading

# filename -> tuple of lines (each with its line ending), or None when unreadable.
SOURCES: dict[str, tuple[str, ...] | None] = {}

#: How many sources that are not files on disk SOURCES keeps (notebook cells, a loader's
#: source, generated code registered in linecache, names with no source): the oldest go
#: first. Files on disk are kept for the life of the process: they are bounded by the
#: program's own files, and reading one again could find it edited since its code was compiled.
TEXTS_LIMIT = 256
_texts: dict = {}  # the filenames in SOURCES that are not files on disk, oldest first
_lock = threading.Lock()


def lines(filename: str, module_globals: dict | None = None) -> tuple[str, ...] | None:
    """The lines of `filename` (read once, then cached), or None when it cannot be read."""
    try:
        return SOURCES[filename]
    except KeyError:
        pass
    text, on_disk = _read(filename, module_globals)
    # setdefault: two threads capturing at once agree on one copy.
    found = SOURCES.setdefault(filename, text)
    if not on_disk:
        with _lock:
            _texts[filename] = None
            while len(_texts) > TEXTS_LIMIT:
                oldest = next(iter(_texts))
                del _texts[oldest]
                SOURCES.pop(oldest, None)  # read again (from linecache) if a site there is captured again
    return found


def _read(filename: str, module_globals: dict | None) -> tuple[tuple[str, ...] | None, bool]:
    """(lines or None, whether they come from a file on disk)."""
    if filename == "<string>":
        return _command_line_source(module_globals), False
    import linecache  # here: it imports tokenize, which would cost `import interlace` ~1 ms

    # Drop a stale linecache entry for a file on disk (entries registered by IPython or a
    # loader have no mtime and are kept by checkcache).
    linecache.checkcache(filename)
    found = linecache.getlines(filename, module_globals)
    entry = linecache.cache.get(filename)
    on_disk = entry is not None and len(entry) == 4 and entry[1] is not None  # (size, mtime, lines, path)
    return (tuple(found) if found else None), on_disk


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
