"""BLOCKS: the captured `with` block (`block.Block`) of each call site, memoised.

`capture(frame, steps)` is memoised per call site in `BLOCKS`, keyed by `(id(code), f_lasti)`
with a strong reference to the code object kept next to the verdict: keying by `id` is
required because on 3.12+ `hash(code)` covers the bytecode, which the skip may patch, and the
reference stops the id from being reused by another code object. Negative verdicts
(`WithBlockNotFoundError`, `UnsupportedBlockError`) are cached too, so a bad site costs one
parse, not one per call. A code object seen by a tracer therefore lives as long as its entry;
that is the price of a warm capture being one dict lookup. `BLOCKS` keeps the latest
`BLOCKS_LIMIT` sites (dropping the oldest cannot disturb a trace running there: the trace
holds its Block; the next one captures the site again), and each Block keeps its latest
`FUNCTIONS_LIMIT` compiled bodies.

What a miss does (read the `with` statement's source, check its shape, compile its body) is
`interlace.tracing.syntax`, imported at the first capture: `import interlace` loads no parser
(`ast`, `dis`, `re`). The default steps (`parse_source`, `build_module`, `compile_module`) are
reachable here too (`blocks.parse_source`, ...), loading `syntax` when first used, for
`Tracer`'s steps.
"""

from __future__ import annotations

from ..errors import UnsupportedBlockError, WithBlockNotFoundError
from .block import FUNCTIONS_LIMIT, LOCALS_PARAM, Block, make_function

__all__ = ["BLOCKS", "BLOCKS_LIMIT", "FUNCTIONS_LIMIT", "LOCALS_PARAM", "Block", "capture", "make_function"]

# (id(code), f_lasti, steps key) -> (code, Block | _Refusal); the latest BLOCKS_LIMIT sites.
BLOCKS: dict[tuple, tuple] = {}
#: How many call sites BLOCKS keeps. A program has far fewer; code compiled again and again
#: (a notebook cell run many times, generated code) makes new sites, and each Block holds an
#: AST and compiled code. The oldest go first; meeting an evicted site again captures it again.
BLOCKS_LIMIT = 1024


class _Refusal:
    """A cached negative verdict: raise a fresh error with the same message each time."""

    __slots__ = ("error_type", "message")

    def __init__(self, error_type, message):
        self.error_type = error_type
        self.message = message

    def error(self):
        return self.error_type(self.message)


def capture(frame, steps, key_extra=None):
    """The `Block` for the `with` whose `__enter__` the frame is executing (memoised)."""
    code = frame.f_code
    key = (id(code), frame.f_lasti, key_extra)
    entry = BLOCKS.get(key)
    if entry is None:  # (the entry holds `code`, so its id cannot be reused by another)
        from . import syntax  # here: the parser and its modules load at the first capture

        try:
            verdict = syntax.build_block(frame, steps)
        except (WithBlockNotFoundError, UnsupportedBlockError) as error:
            verdict = _Refusal(type(error), str(error))
        entry = BLOCKS.setdefault(key, (code, verdict))  # two threads at once agree on one
        if len(BLOCKS) > BLOCKS_LIMIT:
            _evict_oldest()
    verdict = entry[1]
    if type(verdict) is _Refusal:
        raise verdict.error()
    return verdict


def _evict_oldest():
    """Drop the oldest sites past BLOCKS_LIMIT. A trace running at a dropped site holds its own
    Block (and plan); the next trace there captures the site again."""
    while len(BLOCKS) > BLOCKS_LIMIT:
        try:
            BLOCKS.pop(next(iter(BLOCKS)), None)
        except (RuntimeError, StopIteration):  # another thread changed BLOCKS meanwhile
            break


# The default steps, and their old shapes, defined in syntax
_STEPS = frozenset({"parse_source", "build_module", "compile_module", "parse", "function_module",
                    "compile_tree", "function_of", "with_line"})


def __getattr__(name):
    if name in _STEPS:
        from . import syntax

        return getattr(syntax, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
