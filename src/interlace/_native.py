"""The one place that chooses the compiled extension or its pure-Python twin.

* `frames`  - `interlace._cframes` (compiled) or `interlace._pyframes` (twin): frame mechanism.
* `hotpath` - `interlace._chotpath` or `interlace._pyhotpath`: the interleaving hot path
  (None while neither exists in this checkout).
* `native`  - True only if every compiled module this checkout has sources for loaded.

Switches (environment, read once at import):

* `INTERLACE_NO_EXTENSIONS=1` forces the twins.
* `INTERLACE_REQUIRE_EXTENSIONS=1` turns a failed import of a compiled module into an
  ImportError that says why (CI uses it to prove the compiled path really ran).

On an interpreter the extension was not written for (3.14+, free-threaded builds, not
CPython) the twins are used and a single `logging` WARNING on the "interlace" logger says
so. A log line rather than a warning: the test suite turns warnings into errors, and a
user cannot act on it anyway.
"""

from __future__ import annotations

import importlib
import os

from .versions import EXTENSION_SUPPORTED, INTERPRETER

NO_EXTENSIONS = os.environ.get("INTERLACE_NO_EXTENSIONS") == "1"
REQUIRE_EXTENSIONS = os.environ.get("INTERLACE_REQUIRE_EXTENSIONS") == "1"
SUPPORTED = EXTENSION_SUPPORTED

#: Why a compiled module is not in use, by module name (empty when all loaded).
why_not: dict = {}


def _expected(compiled: str) -> bool:
    """A compiled module belongs to this checkout if its checked-in `.pyi` stub is here."""
    return os.path.exists(os.path.join(os.path.dirname(__file__), f"{compiled}.pyi"))


def _load(compiled: str, twin: str):
    """Import the compiled module or its twin; returns (module or None, compiled loaded?)."""
    if NO_EXTENSIONS:
        why_not[compiled] = "INTERLACE_NO_EXTENSIONS=1"
    elif not SUPPORTED:
        why_not[compiled] = f"the extension is not written for {INTERPRETER}"
    else:
        try:
            return importlib.import_module(f"interlace.{compiled}"), True
        except ImportError as error:
            if not _expected(compiled):
                pass  # not part of this checkout (yet): the twin is the implementation
            elif REQUIRE_EXTENSIONS:
                raise ImportError(
                    f"INTERLACE_REQUIRE_EXTENSIONS=1 but interlace.{compiled} did not load: {error}. "
                    f"Build it with `python setup.py build_ext --inplace` (needs a C compiler and Cython)."
                ) from error
            else:
                why_not[compiled] = f"import failed: {error}"
    try:
        return importlib.import_module(f"interlace.{twin}"), False
    except ModuleNotFoundError as error:
        if error.name != f"interlace.{twin}":
            raise
        return None, False


if REQUIRE_EXTENSIONS and not NO_EXTENSIONS and not SUPPORTED:
    raise ImportError(f"INTERLACE_REQUIRE_EXTENSIONS=1 but interlace's extension is not written for {INTERPRETER}")

frames, _frames_native = _load("_cframes", "_pyframes")
hotpath, _hotpath_native = _load("_chotpath", "_pyhotpath")

#: True only if the compiled modules that exist in this checkout loaded.
native: bool = _frames_native and (_hotpath_native or not _expected("_chotpath"))

if not SUPPORTED and not NO_EXTENSIONS:
    import logging  # here, not at the top: logging (and re, enum) would cost every import ~10 ms

    logging.getLogger("interlace").warning("interlace: %s; using the pure-Python twins", why_not.get("_cframes"))

__all__ = ["native", "frames", "hotpath", "why_not"]
