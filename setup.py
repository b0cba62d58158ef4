"""Declares the optional native extension; everything else lives in pyproject.toml.

The extension reads interpreter internals, so it is built per CPython minor version
(3.10-3.13, no stable ABI) and never for interpreters it was not written for (3.14+,
free-threaded builds). Without a compiler the pure-Python package still installs,
unless INTERLACE_REQUIRE_EXTENSIONS=1 asks for a loud failure.
"""

import os
import runpy
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

REQUIRE = os.environ.get("INTERLACE_REQUIRE_EXTENSIONS") == "1"
SKIP = os.environ.get("INTERLACE_NO_EXTENSIONS") == "1"
# The one definition, in the package's version leaf (read as a file: the package is not
# importable while it is being built).
SUPPORTED = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "interlace",
                                        "versions.py"))["EXTENSION_SUPPORTED"]


class OptionalBuildExt(build_ext):
    """Build the extension, but fall back to the pure-Python twin if that fails."""

    def run(self):
        try:
            super().run()
        except Exception as error:  # noqa: BLE001 - any build failure means "use the twin"
            self._fallback(error)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001 - any build failure means "use the twin"
            self._fallback(error)

    def _fallback(self, error):
        if REQUIRE:
            raise
        print(f"interlace: native extension not built ({error}); using the pure-Python twin")


# Calls into libpython through the GOT rather than a PLT stub each: a warm trace then touches
# about 70 fewer lines of the extensions' machine code (callgrind, tiny GPT-2, save one), and
# on a small model a trace's cost follows the lines it touches (docs/architecture.md).
NO_PLT = ["-fno-plt"] if sys.platform.startswith("linux") else []


def extensions():
    if SKIP or not SUPPORTED:
        if REQUIRE:
            raise SystemExit(
                f"interlace: INTERLACE_REQUIRE_EXTENSIONS=1 but the extension is not built for "
                f"{sys.implementation.name} {sys.version.split()[0]}"
            )
        return []
    from Cython.Build import cythonize
    from setuptools import Extension

    return cythonize(
        [
            Extension(
                f"interlace.{name}",
                [f"csrc/{name}.pyx"]
                + ([f"csrc/{name}_impl.c"] if os.path.exists(f"csrc/{name}_impl.c") else []),
                include_dirs=["csrc"],
                extra_compile_args=NO_PLT,
            )
            for name in ("_cframes", "_chotpath")
            if os.path.exists(f"csrc/{name}.pyx")
        ],
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False},
        quiet=True,
    )


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
