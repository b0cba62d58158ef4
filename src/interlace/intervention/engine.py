"""The engine of one wrapped model: what it knows across traces, and the one way to run it.

`Model`/`LanguageModel` (and a bare `Envoy(module)` root) each compose one `Engine`; every
Envoy of the tree and every tracer of the model hold that same engine, and everything that
runs the model - a trace, its invokes, a generation, a sweep's batch, an edited wrapper called
directly - goes through `Engine.interleave`. What differs between those callers is passed
in as *strategies*, not found on the model:

- `batcher` (`batching.Batcher`): how several invokes' inputs become one batch and which
  rows each invoke sees. The engine has a default (a language model's tokenizes and
  left-pads); a call may pass another.
- `run`: how one run calls the model on the batched inputs (a language model's forward with
  extra keywords, its `generate`, a `@traceable` method). `None`: one plain call of the root
  module, whose input and output the engine hands over itself (no hook on the root).

The engine holds its module, never its wrapper or an Envoy (Envoys are kept weakly), so a
wrapped model is freed by reference counting alone. One run per model at a time: two threads
tracing one model take turns; a trace of the model inside its own running body is an error.
Nested traces of several models in several threads never hang: a thread that would wait for
a model whose tracer waits (maybe through others) for a model this thread is tracing raises
an `InterlaceError` naming them (`_Waits`, a wait-for graph) instead of waiting forever.
"""

from __future__ import annotations

import itertools
import operator
import threading
import warnings
import weakref
from threading import get_ident

from ..errors import BatchingWarning, InterlaceError
from .axes import Learner
from .batching import Batcher, BatchingError, RunAlone
from .express import ENABLED as _EXPRESS
from .express import Express
from .interleaver import Interleaver
from .routes import GENERATOR, eligible
from .state import ModelState

_PLAIN = Batcher()
GENERAL = object()  # `Engine.express_trace`'s "not an express run: call `interleave`"


class Engine:
    """One wrapped model's state (locations, learned order, whose turn, the running trace)
    and `interleave`, the single entry that runs it with bodies interleaved."""

    def __init__(self, module, *, batcher=None, aliases=None, envoy_classes=None,
                 batch_dim=None):
        self.state = ModelState(module)
        self.batcher = batcher if batcher is not None else _PLAIN
        self.batch_dim = batch_dim  # given by the user (Model(batch_dim=)), else None
        self.sequence_first = None  # (path, module) of a batch_first=False module, or ()
        self.warned = set()  # locations whose items ran alone (warned once each)
        self.ran_alone = 0  # batched runs whose items ran alone instead
        self.lock = threading.Lock()
        self.owner = None  # thread ident of the running trace
        # The running general Interleaver (whatever thread runs it), or None: `running` less
        # its express check, for a caller that has seen `express` is None (a body's reads)
        self.general_run = None
        self.express = None  # the express run in progress, until it hands over (express.py)
        self._express = None  # this engine's Express (made at its first express run)
        self._express_tracer = None  # the tracer class `eligible` last allowed an express run
        self._bystander = None  # `running` for other threads during an express run
        self.collecting = False  # a trace without inputs is running its body to find invokes
        # The Envoy of each module index, weakly (the root's tree owns them): one Envoy per
        # module even when two paths reach it. Aliases (rename=): {envoy path: {alias: path}}.
        self.envoys = weakref.WeakValueDictionary()
        self.aliases = aliases or {}
        self.envoy_classes = envoy_classes  # Model(..., envoys=): which Envoy class wraps which module
        # Interleavers whose run ended with a complete teardown, reused by later runs (a
        # trace's fixed cost). Idle ones hold nothing of a run: no body, value or frame.
        self.idle = []

    @property
    def module(self):
        """The wrapped torch module (the root of the tree)."""
        return self.state.root

    @property
    def running(self):
        """The running Interleaver (whatever thread runs it), or None. During an express run
        (express.py) asking for it from the tracing thread hands the run over to the general
        one, which is then returned; other threads get an interleaver that runs nothing, whose
        checks tell them why nothing can be read there."""
        express = self.express
        if express is None:
            return self.general_run
        if self.owner == threading.get_ident():
            return express.hand_over()
        if self._bystander is None:
            self._bystander = Interleaver(self.state)
        return self._bystander

    @running.setter
    def running(self, interleaver):
        self.general_run = interleaver

    def active(self):
        """The interleaver running a trace of this model in *this* thread, if any."""
        if self.owner == threading.get_ident():
            return self.running
        return None

    def interleave(self, invokes, *, run=None, batcher=None, backward=False, edits=(),
                   rows=None):
        """Run the model once with one mediator per `(fn, args, kwargs)` in `invokes`.

        Each `fn` is a body (normally a captured `with` block's); with several invokes their
        inputs are batched by `batcher` (default: the engine's) and each body sees only its
        own rows. `run` calls the model on the batched inputs (None: the module itself);
        `backward=True` lets bodies use `with loss.backward():`; `edits` are zero-argument
        factories of bodies replayed before each invoke's own body, on its rows
        (`model.edit()`). Returns the model's return value.
        """
        try:
            interleaver = self.idle.pop()  # atomic: two threads never get the same one
        except IndexError:
            interleaver = Interleaver(self.state)
        interleaver.reset(backward)
        if (len(invokes) == 1 and not edits and run is None and batcher is None
                and type(self.batcher) is Batcher):
            # the common trace: one input as given, nothing to batch or replay
            fn, args, kwargs = invokes[0]
            interleaver.add(fn)
            call = self.state.root
        else:
            call, args, kwargs = self._build(interleaver, invokes, run, batcher, edits, rows)
        # This model's turn (other threads' traces first), then the run.
        together = False
        learning = None
        me = threading.get_ident()
        if self.lock.acquire(blocking=False):
            self.owner = me
        else:
            if self.owner == me:
                raise InterlaceError(
                    "this model is already being traced in this thread: a trace of the same "
                    "model cannot start inside another one's body; trace it after the outer "
                    "block, or wrap a second copy of the module"
                )
            _WAITS.acquire(self, me)
        self.running = interleaver
        try:
            if interleaver.total is not None:
                layouts = self.state.layouts
                if layouts is None:  # the model's first batched run: learn (axes.py)
                    interleaver.learner = Learner(self.state, interleaver.total,
                                                  interleaver.dim)
                    layouts = interleaver.learner.signatures
                interleaver.layouts = layouts
            learning = interleaver.learner
            result = interleaver.run(call, args, kwargs, run is None)
            if learning is not None and self.batch_dim:
                self._check_carried(learning.signatures)
            return result
        except RunAlone as signal:
            if learning is not None and self.batch_dim:
                self._check_carried(learning.signatures)
            alone = signal
        except Exception as error:
            if not (interleaver.expanded and interleaver.model_failed):
                raise
            # an item's edit gave a shared value a batch axis, and the model rejected it
            alone = RunAlone(None, f"shared by the batch, and the model raised {type(error).__name__} "
                                   f"({error}) after an item's edit gave it a batch axis")
        finally:
            together = interleaver.together
            self.running = None
            self.owner = None
            self.lock.release()
            if interleaver.reusable and len(self.idle) < 2:
                self.idle.append(interleaver)
        return self._run_alone(alone, together, invokes, run, batcher, backward, edits)

    def express_trace(self, body, out, args, kwargs):
        """`interleave([(BodyJob(body, out), args, kwargs)])` as an express run (express.py)
        when it can be one: the body takes the generator route, the model's order is learned,
        its inputs are used as given or prepared by the engine's batcher as one invoke's (a
        language model's prompt), nobody runs it now. Else GENERAL, having run nothing."""
        if not _EXPRESS or self.state.order is None:
            return GENERAL
        # `eligible(body)`, asked only of a tracer class other than the one it last allowed:
        # a call, a module's globals and a class dict fewer per trace (on the cache lines a
        # forward left cold, such a call costs microseconds, not its warm 0.1)
        if type(body.tracer) is not self._express_tracer or body.globals is None:
            if eligible(body) is None:
                return GENERAL
            self._express_tracer = type(body.tracer)
        if body.block.route is not GENERATOR:
            return GENERAL
        batcher = self.batcher
        if type(batcher) is not Batcher:  # as `_build` does for one invoke
            batcher = batcher.for_run(None)
            if not batcher.as_given:
                args, kwargs = batcher.batch([batcher.prepare(args, kwargs)])
        if not self.lock.acquire(False):
            return GENERAL  # (another run has the model: `interleave` waits, or says why not)
        self.owner = get_ident()
        express = self._express
        if express is None:
            express = self._express = Express(self.state)
        return express.run(self, body, out, args, kwargs)  # (it releases the lock)

    def _run_alone(self, signal, together, invokes, run, batcher, backward, edits):
        """A batched run could not give an item its own value (`RunAlone`): run each invoke
        alone instead (their bodies run again: side effects repeat), warning once per
        location; invokes that share variables or wait at a barrier cannot run apart."""
        state = self.state
        name = ("the model's output (tracer.result, sweep.output)" if signal.key == state.result_key
                else state.key_name(signal.key) if signal.key is not None else "a value")
        where = signal.where
        at = f" at {where[0]}:{where[1]}" if where else ""
        who = signal.label or "an item"
        if together:
            raise InterlaceError(
                f"{who} reads {name}{at}, which is {signal.why}: its own value needs a run of "
                f"its own, but these invokes share variables or wait at a barrier, so they "
                f"cannot run apart. Read it in a trace of its own (or pass each invoke's "
                f"inputs so that the value has a batch dimension, e.g. a per-row loss)"
            ) from None
        self.ran_alone += 1
        if signal.key not in self.warned:
            self.warned.add(signal.key)
            message = (
                f"{name} is {signal.why}, so no item of a batch can get its own value from a "
                f"batched run: the items ran alone, one forward pass each (their bodies ran "
                f"again: side effects such as prints or appends repeat, saved values are "
                f"recorded once). Said once per location; see docs/batching.md"
            )
            if where:
                warnings.warn_explicit(BatchingWarning(message), BatchingWarning, where[0], where[1])
            else:
                warnings.warn(BatchingWarning(message), stacklevel=3)
        result = None
        for invoke in invokes:
            result = self.interleave([invoke], run=run, batcher=batcher, backward=backward,
                                     edits=edits)
        return result

    def _check_carried(self, layouts):
        """After learning: some value computed from the inputs must carry the batch along
        `batch_dim` (beyond the inputs themselves), else `batch_dim` names the wrong dim."""
        dim = self.batch_dim
        if any(leaf[1] and leaf[3] == dim for key, leaves in layouts.items() if key
               for leaf in leaves):
            return
        self.state.layouts = None
        raise BatchingError(
            f"batch_dim={dim}: the inputs were batched along dim {dim}, but no value the model "
            f"computed from them carries the batch there, so no item's values can be told "
            f"apart; give interlace.Model the dim its inputs are batched along (batch_dim=0 "
            f"for (batch, ...) inputs, 1 for (sequence, batch, ...))"
        )

    def check_batch_dim(self, batcher):
        """Refuse to batch a model with a sequence-first module until `batch_dim` is given:
        concatenating its inputs on dim 0 would batch along time."""
        if self.batch_dim is not None or batcher.batch_first:
            return
        if self.sequence_first is None:
            found = ()
            for path, module in zip(self.state.paths, self.state.modules):
                if getattr(module, "batch_first", None) is False:
                    found = (path, module)
                    break
            self.sequence_first = found
        if self.sequence_first:
            path, module = self.sequence_first
            raise BatchingError(
                f"cannot batch this model: {path} ({type(module).__name__}) takes batch_first="
                f"False inputs (sequence, batch, ...), so concatenating invokes or sweep items "
                f"along dim 0 would batch along time. Say where the batch is: "
                f"interlace.Model(module, batch_dim=1) for sequence-first inputs, or "
                f"batch_dim=0 if the model transposes its inputs itself"
            )

    def _build(self, interleaver, invokes, run, batcher, edits, rows=None):
        """Add the mediators of a run that batches, replays edits or has a run strategy;
        returns `(call, args, kwargs)` for it. `rows`: one input as given whose `rows` batch
        rows each get their own replay of the edits, as invokes would (`as_module()` calls)."""
        batcher = (batcher or self.batcher).for_run(run)
        call = self.state.root if run is None else run
        if len(invokes) == 1 and batcher.as_given:
            # one input as given: nothing to batch
            fn, args, kwargs = invokes[0]
            if rows is not None and rows > 1 and edits:
                interleaver.total = rows
                interleaver.dim = batcher.dim
                _add_edits(interleaver, edits, [slice(i, i + 1) for i in range(rows)])
                interleaver.add(fn)
                return call, args, kwargs
            _add_edits(interleaver, edits, [None])
            interleaver.add(fn)
            return call, args, kwargs
        n = len(invokes)
        if n > 1:
            self.check_batch_dim(batcher)
        if n > 1 and type(batcher) is Batcher and _same_inputs(invokes):
            # every invoke passes the very same inputs (a sweep's shared input): prepared
            # once, repeated as one op, its rows evenly split (no step per invoke)
            args, kwargs, rows = batcher.repeated(batcher.prepare(*invokes[0][1:]), n)
        elif n < 2 or (quick := batcher.batch_invokes(invokes)) is None:
            prepared = _prepare_all(batcher, invokes)
            args, kwargs = batcher.batch(prepared) if prepared else ((), {})
            rows = batcher.slices(prepared) if n > 1 else None
        else:  # (the batcher's own shortcut: no step per invoke)
            args, kwargs, rows = quick
        if n > 1:
            interleaver.total = rows[-1].stop
            interleaver.dim = batcher.dim
            _add_edits(interleaver, edits, rows)
            interleaver.add_all(list(map(_first, invokes)), rows, invoke_labels(n))
        else:
            if invokes:
                _add_edits(interleaver, edits, [None])
            for fn, _, _ in invokes:
                interleaver.add(fn)
        return call, args, kwargs


_INVOKE_LABELS = []


def invoke_labels(n):
    """"invoke 0", "invoke 1", ...: at least `n` of them, made once (a sweep's batch labels
    every item). The list is shared: read it, do not change it."""
    labels = _INVOKE_LABELS
    if len(labels) < n:
        labels.extend(f"invoke {i}" for i in range(len(labels), n))
    return labels


_first = operator.itemgetter(0)  # an invoke's (fn, args, kwargs) parts
_ARGS = operator.itemgetter(1)
_KWARGS = operator.itemgetter(2)


def _same_inputs(invokes):
    """Do all `invokes` pass the very same argument tuple and keyword dict (by identity)?"""
    _, args, kwargs = invokes[0]
    return (all(map(operator.is_, map(_ARGS, invokes), itertools.repeat(args)))
            and all(map(operator.is_, map(_KWARGS, invokes), itertools.repeat(kwargs))))


def _prepare_all(batcher, invokes):
    """`batcher.prepare` of each invoke's inputs. The default batcher's is a function of
    its arguments alone, so invokes that pass the very same ones (the sweep items of a shared
    input) share one answer: one call per run, not one per item."""
    prepare = batcher.prepare
    if type(batcher).prepare is not Batcher.prepare:
        return list(map(prepare, map(_ARGS, invokes), map(_KWARGS, invokes)))
    prepared = []
    last_args = last_kwargs = last = None
    for _, args, kwargs in invokes:
        if args is not last_args or kwargs is not last_kwargs:
            last_args, last_kwargs, last = args, kwargs, prepare(args, kwargs)
        prepared.append(last)
    return prepared


def _add_edits(interleaver, edits, rows_per_invoke):
    """One mediator per edit for each invoke's rows, before the run's own bodies."""
    if not edits:
        return
    for i, rows in enumerate(rows_per_invoke):
        label = "edit" if rows is None else f"edit for invoke {i}"
        for make in edits:
            interleaver.add(make(), rows, label=label)


class _Waits:
    """Which thread waits for which engine: the wait-for graph that keeps nested traces of
    several models in several threads from hanging.

    A thread about to wait for an engine follows the graph from it (engine -> the thread
    tracing it -> the engine that thread waits for -> ...); reaching itself means every
    thread on the way would wait forever, so it raises instead. Checking and registering
    happen under one mutex, so of the threads closing a cycle the last one sees it. An
    engine's `owner` is set before its thread can wait for anything else (untaken engines
    skip the graph), and under the mutex when it was waited for.
    """

    def __init__(self):
        self.mutex = threading.Lock()
        self.waiting = {}  # thread ident -> the engine it waits for

    def acquire(self, engine, me):
        """Take `engine`'s lock for thread `me`, or raise if waiting would deadlock."""
        with self.mutex:
            cycle = self.cycle(engine, me)
            if cycle is not None:
                raise InterlaceError(_deadlock_message(cycle))
            self.waiting[me] = engine
        taken = False
        try:
            taken = engine.lock.acquire()
        finally:
            with self.mutex:
                del self.waiting[me]
                if taken:
                    engine.owner = me

    def cycle(self, engine, me):
        """[(engine, its owner)...] from `engine` round to one `me` holds, or None."""
        path, seen = [], set()
        while True:
            owner = engine.owner
            if owner is None or owner in seen:
                return None
            path.append((engine, owner))
            if owner == me:
                return path
            seen.add(owner)
            engine = self.waiting.get(owner)
            if engine is None:
                return None


_WAITS = _Waits()


def _deadlock_message(cycle):
    """Name the models of a wait-for cycle and the threads holding them, and what to do."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    wanted, holder = cycle[0]
    steps = [f"this thread would wait for {_describe(wanted)}, which thread "
             f"{names.get(holder, holder)!r} is tracing"]
    for engine, owner in cycle[1:-1]:
        steps.append(f"while it waits for {_describe(engine)}, which thread "
                     f"{names.get(owner, owner)!r} is tracing")
    mine = cycle[-1][0]
    steps.append(f"while it waits for {_describe(mine)}, which this thread is tracing "
                 f"(the trace that would wait is nested in its body)")
    return (
        "deadlock: " + ", ".join(steps) + ". None of them could ever go on. Nest traces of "
        "several models in the same order in every thread (always the same model outermost), "
        "trace them one after the other instead of nested, or give each thread its own copy "
        "of the module"
    )


def _describe(engine):
    module = engine.module
    return f"the {type(module).__name__} model (module at {id(module):#x})"
