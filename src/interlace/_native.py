"""The one place that chooses the compiled extension or its pure-Python twin.

* `frames`  - `interlace._cframes` (compiled) or `interlace._pyframes` (twin): frame mechanism.
* `hotpath` - `interlace._chotpath` or `interlace._pyhotpath`: the interleaving hot path.
* `native`  - True only if both compiled modules loaded.

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


def _load(compiled: str, twin: str):
    """Import the compiled module or its twin; returns (module, compiled loaded?)."""
    if NO_EXTENSIONS:
        why_not[compiled] = "INTERLACE_NO_EXTENSIONS=1"
    elif not SUPPORTED:
        why_not[compiled] = f"the extension is not written for {INTERPRETER}"
    else:
        try:
            return importlib.import_module(f"interlace.{compiled}"), True
        except ImportError as error:
            if REQUIRE_EXTENSIONS:
                raise ImportError(
                    f"INTERLACE_REQUIRE_EXTENSIONS=1 but interlace.{compiled} did not load: {error}. "
                    f"Build it with `python setup.py build_ext --inplace` (needs a C compiler and Cython)."
                ) from error
            else:
                why_not[compiled] = f"import failed: {error}"
    return importlib.import_module(f"interlace.{twin}"), False


if REQUIRE_EXTENSIONS and not NO_EXTENSIONS and not SUPPORTED:
    raise ImportError(f"INTERLACE_REQUIRE_EXTENSIONS=1 but interlace's extension is not written for {INTERPRETER}")

frames, _frames_native = _load("_cframes", "_pyframes")
hotpath, _hotpath_native = _load("_chotpath", "_pyhotpath")

#: True only if both compiled modules loaded.
native: bool = _frames_native and _hotpath_native

if not SUPPORTED and not NO_EXTENSIONS:
    import logging  # here, not at the top: logging (and re, enum) would cost every import ~10 ms

    logging.getLogger("interlace").warning("interlace: %s; using the pure-Python twins", why_not.get("_cframes"))

__all__ = ["native", "frames", "hotpath", "why_not"]
