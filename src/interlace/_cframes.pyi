"""Stub of the compiled frame mechanism (csrc/_cframes.pyx + _cframes_impl.c).

The pure-Python twin `interlace._pyframes` has the same names and behaviour (it always
raises instead of jumping, and cannot patch bytecode).
"""

from types import CodeType, FrameType
from typing import Any, Final, Iterable, Mapping

COMPILED: Final[bool]
JUMP: Final[int]                # move the frame to the verified normal exit
RAISE_LINE: Final[int]          # raise SkipSignal at the body start's line event
RAISE_INSTRUCTION: Final[int]   # raise SkipSignal at the body start's instruction event (3.12+)

class SkipSignal(BaseException):
    """Raised at a body start in raise mode; suppressed by the tracer's __exit__."""

def arm(frame: FrameType, lo: int, hi: int, exit_unit: int, mode: int) -> Any:
    """Arm a skip of `frame` at body code units lo..hi; returns the handle for `disarm`.

    3.10/3.11: installs a one-shot C trace function chained to the thread's previous one.
    3.12+: records the frame for the sys.monitoring callbacks."""

def disarm(handle: Any) -> bool:
    """Undo `arm` (restoring any chained tracer exactly); True if the skip fired."""

def prepare(
    code: CodeType,
    line_units: Iterable[int],
    instruction_units: Iterable[int],
    lines: Iterable[int],
    fused_prev_units: Iterable[int] = ...,
    guard_units: Iterable[int] = ...,
) -> None:
    """3.12+: enable our tool's LINE (and INSTRUCTION) events on `code`, once; no-op before.

    3.13: each fused read at `guard_units` (LOAD_FAST_LOAD_FAST, STORE_FAST_LOAD_FAST) gets
    an INSTRUCTION event that raises UnboundLocalError when a local it reads is unbound,
    as the interpreter would for a checked read (the twin accepts none)."""

def patch_checks(code: CodeType, units: Iterable[int], prev_units: Iterable[int] = ...) -> int:
    """3.12+: rewrite the LOAD_FAST at each unit to LOAD_FAST_CHECK in place."""

def redirect(code: CodeType, unit: int, delta: int) -> None:
    """3.13: turn the fused read at `unit` into JUMP_FORWARD `delta` (into the handler's
    checked copy of the same tail)."""

def write_back(frame: FrameType, values: Mapping[str, Any]) -> None:
    """Write values into the frame: fast locals and cells, module globals, class bodies."""

def tracer_methods(
    cls: type,
    enter: Any,
    exit: Any,
    aenter: Any,
    aexit: Any,
    clean: Any,
    blocks: dict,
    block_type: type,
    plan_type: type,
    enter_code_ids: set,
    local: Any,
    current: Any,
) -> tuple[Any, Any, Any, Any]:
    """(__enter__, __exit__, __aenter__, __aexit__) for the Tracer class: C methods doing a
    warm site's lookup, arm, disarm and backend call, calling the Python
    `enter(self, frame)` / `exit(self, t, v, tb, fired)` for everything else (a miss,
    pass-only bodies, subclass __enter__ chains, exceptions). Every error leaving them is
    passed to `clean(error, None)` first, which drops interlace's frames from its traceback;
    they add none of their own. The C __aenter__/__aexit__ call __enter__/__exit__ and
    return a done awaitable. The twin returns `enter`, `exit`, `aenter`, `aexit` unchanged."""

def armed_count() -> int:
    """Armed handles not yet disarmed (3.12+; 0 on 3.10/3.11)."""

class FastSkip:
    """A skip-only context manager in C for warm sites: `plans` maps (id(code), f_lasti)
    to a SkipPlan's `arm_args`; a miss raises KeyError. No Python frame runs between
    arming and the body start."""

    def __init__(self, plans: dict) -> None: ...
    def __enter__(self) -> "FastSkip": ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool: ...
