"""`model.trace(...)` and `tracer.invoke(...)`: the tracer core's blocks, run by the engine.

`InterleavingTracer` is a `Tracer` whose backend runs the captured body as a mediator while
the model runs. With inputs (`model.trace(x)`) the whole body is one mediator. Without
(`model.trace()`), the body runs first, alone: each `with tracer.invoke(x):` block in it is
itself captured and skipped, and only registers its body and inputs; then the inputs are
batched into one forward pass with one mediator per invoke body, each seeing its own rows.
"""

from __future__ import annotations

import builtins
import functools
import itertools
import operator
import sys
from collections import namedtuple

from .._native import hotpath
from ..errors import InterlaceError
from ..tracing import Backend, Tracer
from ..tracing.generators import Ready
from .body import BodyJob
from .access import active_interleaver
from .edit import replays
from .engine import GENERAL
from .grads import block_uses_backward, followed_by_with
from .iteration import IterMixin

_NOT_YET = object()
_new_run = tuple.__new__  # an `_InvokeRun` made by one C call
_CPU = "cpu"  # tracer.cache's default device (a string: importing torch here is not needed)
_BUILTINS = builtins.__dict__


class InterleavingTracer(IterMixin, Tracer):
    """`with model.trace(*inputs) as tracer:` - see the module docstring."""

    # Defaults every trace shares (a class attribute costs no store per trace): `_result` is
    # the run's return value; `_invokes` and `_invoke_assigns` (names their bodies assign, see
    # _InvokeBackend) are made per trace only by a `model.trace()` with invokes
    # (`run_invokes`), which sets `_collecting`.
    _result = _NOT_YET
    _collecting = False
    _invokes = ()
    _invoke_assigns = frozenset()

    def __init__(self, model, args=(), kwargs=None, run=None, batcher=None):
        cls = type(self)
        if ((cls is InterleavingTracer or cls._fields_direct) and type(args) is tuple
                and not (kwargs and "backend" in kwargs)):
            # TracerBase's fields stored as its __init__ would (a C call with `*args` and a
            # keyword dict costs about 4x these stores, on every trace)
            self.args = args
            if kwargs:
                self.kwargs = dict(kwargs)
            elif _EMPTY_KWARGS_STORED:
                self.kwargs = {}
            self.backend = _INTERLEAVING
        else:
            super().__init__(*args, backend=_INTERLEAVING, **(kwargs or {}))
        self.model = model
        self.engine = model.__dict__["_engine"]  # engine_of(model), inline: what runs it (engine.py)
        self._run = run  # how one run calls the model (default: its module, see Engine.interleave)
        self._batcher = batcher  # how invokes' inputs are batched (default: the engine's)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._fields_direct = _next_init(cls) is _TRACER_INIT

    def invoke(self, *args, **kwargs):
        """`with tracer.invoke(*inputs):` - one batch entry whose body sees only its rows."""
        if self.args or self.kwargs:
            raise InterlaceError(
                "this trace already has inputs (model.trace(x)); to batch several inputs, call "
                "model.trace() with no inputs and give each one its own `with tracer.invoke(x):`"
            )
        if not self._collecting:
            raise InterlaceError(
                "tracer.invoke(...) works only as `with tracer.invoke(...):` inside the body of "
                "its own `with model.trace() as tracer:` block"
            )
        return Invoker(self, args, kwargs)

    def cache(self, modules=None, device=_CPU, dtype=None, detach=True, include_output=True,
              include_inputs=False, non_blocking=False):
        """Record every module's output (or `modules=`: Envoys or paths), as the model passes
        it on after this trace's edits; returns a saved mapping path -> values (one entry per
        step under generation). Call it before the body reads anything. See docs/cache.md."""
        from .cache import make_cache

        return make_cache(self, modules, device, dtype, detach, include_output, include_inputs,
                          non_blocking)

    def barrier(self, n):
        """A meeting point for `n` invoke bodies: each calls `barrier()`, and none goes on until
        all `n` have arrived. See docs/barrier.md."""
        from .barrier import make_barrier

        return make_barrier(self, n)

    def stop(self):
        """End the forward pass here; the body ends too, and what it saved so far is kept."""
        interleaver = None if self.engine is None else self.engine.active()
        if interleaver is None:
            raise InterlaceError("tracer.stop() works only inside the body of a running trace")
        interleaver.stop()

    @property
    def result(self):
        """The model's return value: inside the body it waits for the run to end."""
        engine = self.engine
        interleaver = None if engine is None else engine.active()
        if interleaver is not None and interleaver.current is not None:
            return interleaver.read(interleaver.state.result_key)
        if self._result is _NOT_YET:
            raise InterlaceError(
                "tracer.result is the model's return value: read it inside the trace body "
                "(it waits for the model to finish) or after the block"
            )
        return self._result

    def __interlace_read__(self, name):
        """`tracer.result` in a body running as a generator: an iterator that yields until
        the run's end (tracing/generators.py)."""
        engine = self.engine
        if name == "result" and engine is not None and engine.express is not None:
            return engine.express.generator_read(engine.state.result_key)  # (express.py)
        interleaver = None if engine is None else engine.active()
        if name != "result" or interleaver is None or interleaver.current is None:
            return Ready(getattr(self, name))
        return interleaver.generator_read(interleaver.state.result_key)

    def run_untraced(self):
        """`model.trace(*inputs, trace=False)`: run the model on this tracer's inputs with no
        body (nothing is captured, no `with` is needed) and return its output. Inputs are
        prepared as a trace prepares them; the wrapper's recorded edits apply (nnsight's
        one-shot forward)."""
        if not (self.args or self.kwargs):
            raise InterlaceError(
                "model.trace(trace=False) runs the model once on the inputs given to trace(); "
                "none were given: pass them, as in model.trace(x, trace=False)"
            )
        model = self.model
        try:
            return self.engine.interleave(
                [(_untraced, self.args, self.kwargs)], run=self._run, batcher=self._batcher,
                edits=replays(model) if "_edits" in model.__dict__ else (),
            )
        finally:
            self.release()

    def release(self):
        """Let go of the model once the block has run (or raised), as nnsight does: a tracer
        kept after the block (`as tracer`, an invoke's) must not keep the model, its inputs
        or its strategies alive. What the run produced (`result`) stays."""
        self.model = self.engine = self._run = self._batcher = None
        self.args = ()
        if _EMPTY_KWARGS_STORED:
            self.kwargs = {}
        else:  # (natively an unset `kwargs` reads as an empty dict, made on first read)
            self.kwargs = None

    def __getstate__(self):
        state = super().__getstate__()
        state.update(_invokes=[], _invoke_assigns=set(), _result=_NOT_YET, _collecting=False)
        return state


def _next_init(cls):
    """The `__init__` that `InterleavingTracer.__init__`'s `super()` reaches for `cls`."""
    return super(InterleavingTracer, cls).__init__


_TRACER_INIT = Tracer.__init__  # TracerBase's (C natively): what stores the fields
# Whether an unset `kwargs` field reads as None (the twin's plain attribute), so that an
# empty dict must be stored; natively it reads as an empty dict made on first read.
_EMPTY_KWARGS_STORED = Tracer.kwargs is None
InterleavingTracer._fields_direct = _next_init(InterleavingTracer) is _TRACER_INIT


def compiled_trace(slow):
    """A wrapper's `trace` whose common call, `model.trace(*inputs)` with no keyword, makes its
    InterleavingTracer in the compiled extension (`hotpath.tracer_maker`: no Python frame, as
    `slow` would make it for that call: `model`, `engine`, then `_run` and `_batcher` unset);
    every other call is `slow`'s. help() and `inspect.signature` show `slow`."""
    return functools.wraps(slow)(
        hotpath.tracer_maker(slow, InterleavingTracer, _INTERLEAVING, ("_run", "_batcher")))


class Invoker(Tracer):
    """`with tracer.invoke(*inputs):` - registers its body; the trace runs it later, batched.

    Invokes share variables, in invoke order: a name an invoke's body reads but does not
    assign resolves to the value an *earlier* invoke assigned. If that invoke has not
    assigned it yet, the reader waits until it has (the model runs on meanwhile), then
    continues at the very module the earlier invoke was at - so the usual patching pattern
    works without barriers:

        with tracer.invoke(clean):
            h = model.layer.output[:, pos].save()
        with tracer.invoke(corrupt):
            model.layer.output[:, pos] = h     # waits for `h`, then edits the same layer
    """

    def __init__(self, parent, args, kwargs):
        super().__init__(*args, backend=_INVOKE, **kwargs)
        self.parent = parent
        self._deferred = None  # an `_InvokeRun` from __exit__ until the trace has run it


class _SharedGlobals(dict):
    """An invoke body's globals: earlier invokes' variables, then the caller's names as they
    were when the invoke was entered, then the module's globals.

    Empty itself, so every lookup lands in `__missing__`; a name none of them has raises
    KeyError, and Python goes on to the builtins as usual.
    """

    __slots__ = ("_module", "_interleaver", "_caller")

    def __init__(self, module_globals, interleaver, caller):
        super().__init__()
        self._module = module_globals
        self._interleaver = interleaver
        self._caller = caller

    def __missing__(self, name):
        value = self._interleaver.shared_value(name, _NOT_YET)
        if value is not _NOT_YET:
            return value
        caller = self._caller
        if name in caller:
            return caller[name]
        module = self._module
        if name in module or name in _BUILTINS:
            return module[name]  # KeyError for a builtin: Python looks there next
        if self._interleaver.assigned_earlier(name):
            raise NameError(
                f"name {name!r} is not defined: no earlier invoke assigned it before it ended"
            )
        raise KeyError(name)


class _InvokeBackend(Backend):
    """Registers the invoke; runs nothing yet.

    This is where the `with tracer.invoke(...)` stands, so the caller's names the body uses
    are bound HERE (`defer()`), to the objects they refer to now (a loop variable has this
    iteration's value; a list the caller keeps appending to stays the same list). The run
    comes later, after the trace body has finished collecting invokes.
    """

    def __call__(self, invoker):
        parent = invoker.parent
        block = invoker.block
        assigned = block.assigned_names
        before = parent._invoke_assigns  # names the earlier invokes assign (kept as they come)
        if not before:
            shadowed = _NOTHING_SHADOWED
        elif block.kind == "module":  # (its reads are global lookups: any may take)
            shadowed = frozenset(before - assigned)
        else:  # only names the body mentions can come from an earlier invoke
            shadowed = frozenset(before.intersection(block.names) - assigned)
        invoker._deferred = _new_run(_InvokeRun, (parent, invoker.defer(), shadowed))
        parent._invokes.append(invoker)
        if assigned:
            before.update(assigned)


_NOTHING_SHADOWED = frozenset()


class _InvokeRun(namedtuple("_InvokeRun", ("parent", "body", "shadowed"))):
    """How an invoke's deferred body runs: with variables shared between invokes when the
    run has several bodies (`_SharedGlobals`), else as a plain body. `shadowed`: the names an
    earlier invoke assigns and this one only reads. A named tuple, made by one C call per
    invoke (`_new_run`)."""

    __slots__ = ()

    def __call__(self):
        body = self.body
        interleaver = self.parent.engine.active()
        if interleaver is None or interleaver.shared is None:
            return body.run()
        caller = body.namespace
        shadowed = self.shadowed
        # Names an earlier invoke assigns are not parameters: they are looked up (through
        # `_SharedGlobals`) in that earlier body first, and in `caller` only if it never binds them.
        namespace = {name: value for name, value in caller.items() if name not in shadowed} if shadowed else caller
        return body.run(namespace, _SharedGlobals(body.globals, interleaver, caller), reads_as_globals=True)


class _InterleavingBackend(Backend):
    def __call__(self, tracer):
        try:
            args, kwargs = tracer.args, tracer.kwargs  # (each a C field read by name)
            if args or kwargs:  # `model.trace(x)`: the whole body is one mediator
                values = {}
                model = tracer.model
                engine = tracer.engine
                body = tracer.defer()
                result = GENERAL
                # (`_may_run_express(tracer)`, inline: the common trace makes no call for it)
                if tracer._run is None and tracer._batcher is None and "_edits" not in model.__dict__:
                    result = engine.express_trace(body, values, args, kwargs)  # the common trace
                if result is GENERAL:
                    result = engine.interleave(
                        [(BodyJob(body, values), args, kwargs)],
                        run=tracer._run, batcher=tracer._batcher,
                        backward=block_uses_backward(tracer.block),
                        edits=replays(model) if "_edits" in model.__dict__ else (),
                    )
                tracer._result = result
                tracer.push_result(values)
            else:
                self.run_invokes(tracer)
        finally:
            tracer.release()

    def run_invokes(self, tracer):
        """`model.trace()`: run the body to collect its invokes, then run them batched."""
        engine = tracer.engine
        tracer._invokes = []
        tracer._invoke_assigns = set()
        tracer._collecting = True
        engine.collecting = True
        try:
            values = tracer.run_body()
        finally:
            tracer._collecting = False
            engine.collecting = False
        invokes, tracer._invokes = tracer._invokes, []
        tracer._invoke_assigns = set()
        try:
            if invokes:
                outs = list(map(dict, itertools.repeat((), len(invokes))))  # (one {} each)
                result = GENERAL
                if len(invokes) == 1 and _may_run_express(tracer):
                    # one invoke is a trace of its inputs: an express run when it can be one
                    # (`express_trace` refuses a body with `with loss.backward():`, as for any)
                    invoker = invokes[0]
                    result = engine.express_trace(invoker._deferred.body, outs[0],
                                                  invoker.args, invoker.kwargs)
                if result is GENERAL:
                    result = self._interleave(tracer, invokes, outs)
                tracer._result = result
                for out in outs:
                    values.update(out)
        finally:
            for invoker in invokes:
                invoker._deferred = None
        tracer.push_result(values)

    def _interleave(self, tracer, invokes, outs):
        """The general run of the collected `invokes`, batched; each body's locals into its
        dict of `outs`. Returns the model's output."""
        pending = list(map(_DEFERRED, invokes))
        if not any(map(_SHADOWED, pending)):
            # no invoke may take a name from an earlier one: each body runs as a plain
            # body (the generator route, when its site takes it), not by its `_InvokeRun`
            jobs = map(BodyJob, map(_BODY, pending), outs, itertools.repeat(None),
                       map(_SHADOWED, pending))
        else:
            jobs = map(BodyJob, map(_BODY, pending), outs, pending)
        runs = list(zip(jobs, map(_ARGS, invokes), map(_KWARGS, invokes)))
        return tracer.engine.interleave(
            runs, run=tracer._run, batcher=tracer._batcher,
            backward=block_uses_backward(tracer.block), edits=replays(tracer.model),
        )


def _may_run_express(tracer):
    """May `tracer`'s one input (or one invoke's) be an express run (`Engine.express_trace`
    decides the rest)? Not with a run strategy or a batcher of its own, nor with recorded
    edits to replay."""
    return tracer._run is None and tracer._batcher is None and "_edits" not in tracer.model.__dict__


_INTERLEAVING = _InterleavingBackend()
_INVOKE = _InvokeBackend()
# `tracer.invoke(*inputs)` with no keyword makes its Invoker in the compiled extension (no
# Python frame per invoke); every other call, and help(), is InterleavingTracer's method.
InterleavingTracer.invoke = functools.wraps(InterleavingTracer.invoke)(
    hotpath.invoker_maker(InterleavingTracer.invoke, Invoker, _INVOKE, "_collecting", ("_deferred",)))


def _untraced():
    """The body of `trace=False`: none (only the wrapper's edits act)."""


# an invoke's parts, read without a Python step per invoke (run_invokes)
_DEFERRED = operator.attrgetter("_deferred")  # its `_InvokeRun`, made when its `with` was entered
_SHADOWED = operator.attrgetter("shadowed")
_BODY = operator.attrgetter("body")
_ARGS = operator.attrgetter("args")
_KWARGS = operator.attrgetter("kwargs")


def traceable(method):
    """Make an Envoy-subclass method traceable, as nnsight 0.8's `@traceable`:
    `with envoy.method(*inputs):` runs the model through `method` with the body interleaved;
    a plain `envoy.method(*inputs)` just calls it (and inside a trace it always does).
    (Here, not in envoy.py: the Envoy does not import the tracer, the tracer reaches the Envoy.)"""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if active_interleaver(self) is not None or not followed_by_with(sys._getframe(1)):
            return method(self, *args, **kwargs)
        # a trace of the whole model (its root Envoy) whose run calls the method
        return InterleavingTracer(self.root, args, kwargs,
                                  run=lambda *a, **k: method(self, *a, **k))

    wrapper.traceable = True
    return wrapper
