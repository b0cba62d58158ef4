"""interlace's benchmark harness: `python -m benchmarks` (see __main__.py and README.md).

It measures this checkout's interlace (src/), whether or not an interlace is installed, as
do the processes it starts (their PYTHONPATH names src/ too); a process measuring a baseline
(`--baseline REF`) is started with INTERLACE_BENCH_SRC naming that tree's src/ instead.
"""

import os as _os
import sys as _sys

_SRC = _os.environ.get("INTERLACE_BENCH_SRC") or _os.path.join(
    _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "src")
if _sys.path[:1] != [_SRC]:
    _sys.path.insert(0, _SRC)
