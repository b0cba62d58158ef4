"""interlace's benchmark harness: `python -m benchmarks` (see __main__.py and README.md).

It measures this checkout's interlace (src/), whether or not an interlace is installed, as
do the processes it starts (their PYTHONPATH names src/ too).
"""

import os as _os
import sys as _sys

_SRC = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "src")
if _SRC not in _sys.path:
    _sys.path.insert(0, _SRC)
