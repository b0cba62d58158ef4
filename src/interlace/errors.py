"""Every error and warning a user of interlace can see.

Kept in one torch-free leaf module so that `tracing`, `intervention` and `models`
can all raise them without importing each other.
"""


class InterlaceError(Exception):
    """Base class of every error interlace raises on purpose."""


class WithBlockNotFoundError(InterlaceError):
    """A tracer was entered, but no `with` block could be found at the call site.

    The message tells apart "not used as a `with` block" from "the source could not be
    read" (stdin, `exec` of a string, a file edited since it was first read).
    """


class UnsupportedBlockError(InterlaceError):
    """The `with` body has a shape that cannot be skipped (raised at capture time).

    The message names file:line, the shape, and what to write instead.
    """


class NotInTraceError(InterlaceError, ValueError):
    """A value that exists only while a trace runs (`.output`, `.input`, ...) was used outside
    one. A `ValueError` too, as nnsight raises for the same mistake."""


class OutOfOrderError(InterlaceError):
    """A value was requested after the model had passed it, or from a module that never ran."""


class SourceNotAvailable(InterlaceError):
    """`.source` needs Python source, and there is none to read for this forward or call.

    The message names the module (or the operation) and why: a builtin or C function, code
    compiled from a string, a call into a submodule (which has its own `.source`), an
    assignment (which calls nothing).
    """



class BatchingError(InterlaceError, ValueError):
    """The inputs of several invokes cannot be combined into one batch."""


class BarrierError(InterlaceError, ValueError):
    """A barrier used where it cannot work, or one that can never fill."""


class CacheError(InterlaceError, ValueError):
    """`tracer.cache(...)` used where or how it cannot record (a `ValueError`, as in nnsight)."""


class UnknownKeywordError(InterlaceError, TypeError, ValueError):
    """A keyword the model (trace) or transformers' generate (generate) does not take.

    A `TypeError`, as Python raises for an unexpected keyword, and a `ValueError`, as
    transformers' generate raises for unused model kwargs, so either `except` catches it.
    """


class ModelLoadError(InterlaceError, OSError):
    """A model or tokenizer could not be loaded (e.g. a hub id while offline).

    An `OSError` too, because that is what `transformers.from_pretrained` raises for the
    same situations, so code that caught those keeps working.
    """


class MissingExtraError(InterlaceError, ImportError):
    """An optional dependency a feature needs is not installed."""

class IterationCutShortWarning(UserWarning):
    """A `tracer.iter` loop asked for a step the run never reached; the loop ended early."""


class ForwardReplacedWarning(UserWarning):
    """A module's `forward` was replaced after the model was wrapped: traces run the new one,
    but the module order learned from the old one may no longer hold."""


class BatchingWarning(UserWarning):
    """A batched run could not give every item its own value, so some items ran alone
    (their bodies ran again: side effects repeat), or the batch size was lowered."""
