"""Per-Python-version constants and opcode differences, in one place.

A torch-free leaf (like `errors`) that everything asks instead of looking at
`sys.version_info` - the tracer core, `_native` (which interpreters the extension supports),
the pure-Python twin, the compiled extension and `setup.py` (which reads this file without
importing the package): which instruction enters a `with`, what the normal exit of a
`with` looks like, which reads the compiler leaves unchecked, and so on.
"""

from __future__ import annotations

import sys
import sysconfig

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: importing typing costs `import interlace` ~2 ms
    from typing import Final

PY310: Final[bool] = sys.version_info[:2] == (3, 10)
PY311: Final[bool] = sys.version_info[:2] == (3, 11)
PY311_PLUS: Final[bool] = sys.version_info >= (3, 11)
PY312_PLUS: Final[bool] = sys.version_info >= (3, 12)
PY313_PLUS: Final[bool] = sys.version_info >= (3, 13)

#: A free-threaded (no GIL) build.
FREE_THREADED: Final[bool] = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
#: This interpreter in words, for messages: "cpython 3.13.0", "cpython 3.13.0 (free-threaded)".
INTERPRETER: Final[str] = (
    f"{sys.implementation.name} {sys.version.split()[0]}{' (free-threaded)' if FREE_THREADED else ''}"
)

#: The interpreters the native extension was written for (it reads their internals).
EXTENSION_SUPPORTED: Final[bool] = (
    sys.implementation.name == "cpython"
    and (3, 10) <= sys.version_info[:2] <= (3, 13)
    and not FREE_THREADED
)

#: `sys.monitoring` exists (3.12+): skips use LINE events instead of a trace function.
HAS_MONITORING: Final[bool] = hasattr(sys, "monitoring")

#: `code.co_flags` bit of a function body (fast locals); module and class bodies lack it.
#: `inspect.CO_OPTIMIZED`, without importing inspect.
CO_OPTIMIZED: Final[int] = 0x1

#: Instructions that call `__enter__` for a `with` / `async with` item.
WITH_ENTER_OPS: Final[frozenset] = frozenset(
    {"SETUP_WITH", "SETUP_ASYNC_WITH", "BEFORE_WITH", "BEFORE_ASYNC_WITH"}
)

#: Opcodes that open a block on 3.10's block stack (closed by POP_BLOCK).
SETUP_BLOCK_OPS: Final[frozenset] = frozenset(
    {"SETUP_FINALLY", "SETUP_WITH", "SETUP_ASYNC_WITH"}
)

#: Instructions between the `__exit__` call and the final POP_TOP of an async exit
#: (the await loop), skipped when comparing continuations.
AWAIT_LOOP_OPS: Final[frozenset] = frozenset(
    {
        "GET_AWAITABLE", "LOAD_CONST", "SEND", "YIELD_VALUE", "YIELD_FROM", "RESUME",
        "JUMP_BACKWARD_NO_INTERRUPT", "END_SEND", "CLEANUP_THROW", "CACHE", "NOP",
    }
)

#: What the with's handler pops after `__exit__` returned True, before the code after the with.
SUPPRESS_POPS: Final[tuple] = (
    ("POP_TOP", "POP_TOP", "POP_TOP", "POP_EXCEPT", "POP_TOP")
    if PY310
    else ("POP_TOP", "POP_EXCEPT", "POP_TOP", "POP_TOP")
)

#: Unconditional jumps followed when comparing two continuations.
UNCONDITIONAL_JUMPS: Final[frozenset] = frozenset(
    {"JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_ABSOLUTE", "JUMP", "JUMP_NO_INTERRUPT",
     "JUMP_BACKWARD_NO_INTERRUPT"}
)

#: Instructions that end a continuation (nothing after them is reached by fall-through).
TERMINATORS: Final[frozenset] = frozenset(
    {"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE"}
)

#: Instructions with no effect on what a continuation computes.
TRANSPARENT_OPS: Final[frozenset] = frozenset({"NOP", "CACHE"})

#: Reads that the compiler emits without a NULL check because it proved the local bound
#: (3.12+). A skipped body breaks that proof, so they are patched to LOAD_FAST_CHECK.
UNCHECKED_LOAD: Final[str] = "LOAD_FAST"
CHECKED_LOAD: Final[str] = "LOAD_FAST_CHECK"
#: 3.13 fuses two locals into one code unit (oparg = a << 4 | b); no checked form exists.
FUSED_LOADS: Final[frozenset] = frozenset({"LOAD_FAST_LOAD_FAST", "STORE_FAST_LOAD_FAST"})
#: 3.13's fused instructions: what each half of the pair does, first half first.
FUSED_HALVES: Final[dict] = {
    "LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST"),
    "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
    "STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST"),
}
#: The longest JUMP_FORWARD that fits the one code unit of a fused read (no EXTENDED_ARG),
#: in code units: what a 3.13 redirect can reach.
MAX_UNIT_JUMP: Final[int] = 255
#: Whether unchecked reads exist at all (3.10/3.11 LOAD_FAST always checks).
NEEDS_LOAD_CHECKS: Final[bool] = PY312_PLUS
# Reading a function frame's `f_locals` (3.10-3.12) leaves a dict snapshot on the frame that
# keeps those values alive until the next read; 3.13's `f_locals` is a live proxy (PEP 667).
LOCALS_SNAPSHOT: Final[bool] = not PY313_PLUS


def fused_halves(name: str, arg: int) -> tuple:
    """((opname, local index), (opname, local index)) of a 3.13 fused instruction `name`
    with oparg `arg` (first half first), or () if `name` is not fused."""
    halves = FUSED_HALVES.get(name)
    if halves is None:
        return ()
    return ((halves[0], arg >> 4), (halves[1], arg & 15))


def is_exit_call(names: list, args: list, i: int) -> int:
    """Length of the `__exit__(None, None, None)` call starting at instruction index `i`, or 0.

    3.10: LOAD_CONST None; DUP_TOP; DUP_TOP; CALL_FUNCTION 3
    3.11: LOAD_CONST None x3; PRECALL 2; CALL 2      3.12+: LOAD_CONST None x3; CALL 2
    (`args` holds the resolved constant for LOAD_CONST, the oparg otherwise.)
    """
    if PY310:
        pattern = (("LOAD_CONST", None), ("DUP_TOP", ...), ("DUP_TOP", ...), ("CALL_FUNCTION", 3))
    elif PY311:
        pattern = (("LOAD_CONST", None),) * 3 + (("PRECALL", 2), ("CALL", 2))
    else:
        pattern = (("LOAD_CONST", None),) * 3 + (("CALL", 2),)
    if i + len(pattern) > len(names):
        return 0
    for k, (name, arg) in enumerate(pattern):
        if names[i + k] != name or (arg is not ... and args[i + k] != arg):
            return 0
    return len(pattern)
