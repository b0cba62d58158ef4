"""`tracer.iter[...]` and `tracer.all()`: per-step access to a model that runs many times.

Generation calls the model once per new token; each call is one *step*, and each location
(module output/input) happens once per step, so step `n` is occurrence `n` of every location.
A loop `for step in tracer.iter[2:5]:` pins the mediator's iteration pointer to 2, 3, 4 in
turn: the first request of each pass binds to that occurrence, then the pointer relaxes (later
requests bind to the next occurrence not yet passed). The pointer as it was before the loop is
restored when the loop ends, however it ends, so loops nest.

A step the run never reaches (generation stopped, `iter[:10]` after 4 tokens, an open end)
is not an error: the interleaver throws `IterationCutShort` into the parked body, which ends
it -- values saved so far are kept, code after the loop does not run -- and warns with
`IterationCutShortWarning`. Outside a loop the same request is an `OutOfOrderError`.

`with tracer.iter[...]:` is the old form: it re-runs its captured block once per step and
emits a `DeprecationWarning` pointing at the `for` form.
"""

from __future__ import annotations

import itertools
import warnings

from ..errors import InterlaceError
from ..tracing import Backend, Tracer
from .access import engine_of

MAX_IDLE_STEPS = 10_000
"""An open-ended loop whose steps asked the model for nothing this many times in a row is
an error: nothing else could ever end it (a step may skip its requests, e.g. `if step > 0:`)."""


def steps_of(selector):
    """Validate an `iter[...]` selector; return (description, iterable factory, bounded)."""
    if isinstance(selector, bool) or not isinstance(selector, (int, slice, list, tuple, range)):
        if hasattr(selector, "__index__"):
            selector = selector.__index__()
        else:
            raise TypeError(
                f"tracer.iter[...] takes a step (int), a slice (iter[2:5], iter[:]) or a list "
                f"of steps (iter[[0, 2, 4]]), not {type(selector).__name__}"
            )
    if isinstance(selector, int):
        _check_step(selector, f"iter[{selector}]")
        return f"iter[{selector}]", lambda: iter((selector,)), True
    if isinstance(selector, (list, tuple, range)):
        steps = []
        for item in selector:
            if isinstance(item, bool) or not hasattr(item, "__index__"):
                raise TypeError(
                    f"tracer.iter[[...]] takes a list of int steps, got {type(item).__name__} "
                    f"{item!r}"
                )
            steps.append(item.__index__())
        for step in steps:
            _check_step(step, f"iter[{steps}]")
        return f"iter[{steps}]", lambda: iter(steps), True
    start, stop, stride = selector.start, selector.stop, selector.step
    parts = [None if v is None else _as_index(v) for v in (start, stop, stride)]
    start, stop, stride = parts
    text = "iter[" + ":".join("" if v is None else str(v) for v in (start, stop)) + (
        f":{stride}" if stride is not None else "") + "]"
    for value in (start, stop):
        if value is not None:
            _check_step(value, text)
    if stride is not None and stride <= 0:
        raise ValueError(
            f"tracer.{text}: the step of the slice must be positive (steps run forward in "
            f"time), got {stride}"
        )
    start = start or 0
    stride = stride or 1
    if stop is None:
        return text, lambda: itertools.count(start, stride), False
    return text, lambda: iter(range(start, stop, stride)), True


def _as_index(value):
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"tracer.iter slice bounds must be ints, got {type(value).__name__} {value!r}")
    return value.__index__()


def _check_step(step, text):
    if step < 0:
        raise ValueError(
            f"tracer.{text}: negative steps are not allowed (got {step}); a step counts from "
            f"the start of the run, and the end is not known until the model stops. Use "
            f"tracer.iter[n:] or tracer.all() to run to the end"
        )


class Iteration(Tracer):
    """What `tracer.iter[...]` returns: iterate over it (`for step in ...`), or, deprecated,
    use it as a `with` block whose body runs once per step.

    `get_mediator(what)` returns the mediator of the body that is running (an error outside
    a running trace body).
    """

    def __init__(self, get_mediator, selector, text=None):
        default, factory, bounded = steps_of(selector)
        text = text or default
        super().__init__(backend=_PerStepBackend())
        self._get_mediator = get_mediator
        self._text = text
        self._factory = factory
        self._bounded = bounded

    def __repr__(self):
        return f"<tracer.{self._text}>"

    def __iter__(self):
        return self._loop(self._get_mediator(f"tracer.{self._text}"))

    def _loop(self, mediator):
        """Pin the pointer to each step in turn; restore it however the loop ends."""
        pointer = mediator.pointer
        before = pointer.save()
        pointer.depth += 1
        try:
            previous, idle = None, 0
            for step in self._factory():
                if previous is not None and pointer.pinned == previous:  # asked for nothing
                    idle += 1
                    if not self._bounded and idle >= MAX_IDLE_STEPS:
                        raise InterlaceError(
                            f"tracer.{self._text}: {idle} steps in a row asked the model for "
                            f"nothing, so this open-ended loop would never end (only a request "
                            f"for a step the model does not reach ends it); read or edit a value "
                            f"in the loop, or give it an end (tracer.iter[:n])"
                        )
                else:
                    idle = 0
                pointer.pin(step)
                previous = step
                yield step
        finally:
            pointer.restore(before)


class _PerStepBackend(Backend):
    """The deprecated `with tracer.iter[...]:` form: run the captured block once per step.

    Each step's values are pushed to the enclosing body before the next step runs, so a
    step sees what the previous one assigned. A step the run never reaches ends the
    enclosing body too (the interleaver's IterationCutShort propagates), keeping the values
    of the steps that ran. (`__enter__` is the core's own: it must see the user's frame.)
    """

    def __call__(self, tracer):
        block = tracer.block
        form = f"for step in tracer.{tracer._text}:"
        warnings.warn_explicit(
            DeprecationWarning(
                f"`with tracer.{tracer._text}:` is deprecated: it re-runs its block once per "
                f"step; write `{form}` and indent the block under it"
            ),
            DeprecationWarning,
            block.filename,
            block.lineno,
        )
        loop = tracer._loop(tracer._get_mediator(f"tracer.{tracer._text}"))
        try:
            for _ in loop:
                tracer.push_result(tracer.run_body())
        finally:
            loop.close()  # restore the pointer now, not when the generator is collected


class IterMixin:
    """`tracer.iter[...]` and `tracer.all()` for a tracer that has a `model`."""

    @property
    def iter(self):
        """`for step in tracer.iter[2:5]:` - see the module docstring for the semantics."""
        return Indexer(self._running_mediator)

    def all(self):
        """Every step until the model stops: `for step in tracer.all():` (= `iter[:]`)."""
        return Iteration(self._running_mediator, slice(None), text="all()")

    def _running_mediator(self, what):
        model = self.model  # (None once a trace's block has run: it lets go of the model)
        interleaver = None if model is None else engine_of(model).active()
        if interleaver is None or interleaver.current is None:
            raise InterlaceError(
                f"{what} works only inside the body of a running trace or generation "
                f"(`with model.generate(...) as tracer:` then `for step in {what}:`)"
            )
        return interleaver.mediator(what)


class Indexer:
    """`tracer.iter`: indexing it with steps gives the loop to run."""

    __slots__ = ("_get_mediator",)

    def __init__(self, get_mediator):
        self._get_mediator = get_mediator

    def __getitem__(self, selector):
        return Iteration(self._get_mediator, selector)

    def __repr__(self):
        return "<tracer.iter: index with a step, slice or list of steps>"
