"""The interleaver: one run of a model while its mediators read and edit values as they appear.

The run lifecycle (policy on top of the hot path's mechanism, `interlace._native.hotpath`):

1. start every mediator: each body runs until it asks for its first value (or ends);
2. run the model; hooks on the requested locations (`hooks.py`) hand each value over through
   the run's event exchange (`exchange.py`), and a body that asks for a later location is
   hooked there from then on. The root's input is always hooked: it counts root calls
   (generation calls the root once per step);
3. hand the run's result over (`tracer.result`);
4. finish the bodies still waiting: each learns why (the location never ran, the run was
   stopped, an `iter` loop was cut short) - no body is left suspended;
5. teardown, in `finally`: every hook and forward override is removed, parked bodies are
   unwound, features built on the run (`source.py`, `cache.py`) undo what they installed.

The first trace of a model hooks every location and learns their order (`state.py`). With
several invokes, a body's variables are published whenever it pauses (`sharing.py`). Whose
turn it is to run a model (one run per model at a time) is the engine's (`engine.py`).
"""

from __future__ import annotations

import itertools
import operator
import sys
import threading
import warnings

from greenlet import getcurrent
from torch import Tensor

from .._native import hotpath
from ..errors import InterlaceError, IterationCutShortWarning, OutOfOrderError
from ..tracing.tracer import user_frame
from . import attach, compiled, grads, hooks, routes
from .batching import RunAlone, expand, leaf, map_leaves, narrow, put, swap
from .mediator import (
    DONE,
    FAILED,
    PARKED,
    STOPPED,
    GeneratorMediator,
    IterationCutShort,
    Mediator,
    StopSignal,
    _is_grad_enabled,
    _set_grad_enabled,
    WORKERS,
    runs_here,
    runs_within,
)
from .sharing import Sharing, shares


_READ = object()  # `generator_read`'s "no value to write"


class _Abort(BaseException):
    """Unwinds the model's forward after a body failed (the body's error is re-raised)."""


class _Stop(BaseException):
    """Unwinds the model's forward after `tracer.stop()`."""


def _user_line(mediator):
    """(filename, lineno) of the innermost frame of a parked body outside interlace."""
    frame = mediator.paused_frame()
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<interlace>", 0)


_ERROR = operator.attrgetter("error")
_FINISHED = operator.attrgetter("finished")


def _one_generator_route(fns):
    """Do all bodies `fns` share one Block whose route is the generator route?"""
    block = getattr(fns[0], "route_block", None)
    if block is None or block.route is not routes.GENERATOR:
        return False
    blocks = map(getattr, fns, itertools.repeat("route_block"), itertools.repeat(None))
    return all(map(operator.is_, blocks, itertools.repeat(block)))


def note_last_write(error, state, last_write):
    """Add to `error`, which the model raised, where the body last set a value (`last_write`:
    (key, filename, lineno), or None): the likeliest cause (3.11+: a note)."""
    if last_write is not None and hasattr(error, "add_note"):
        key, filename, lineno = last_write
        error.add_note(
            f"interlace: the trace body set {state.key_name(key)} at {filename}:{lineno} "
            f"before the model raised this; check the value assigned there"
        )


class Interleaver(hotpath.Exchange):
    """One run of a model with its mediators (one per body / invoke).

    It is its own event exchange (`exchange.py`): `hub`, `current` (the mediator running
    now), `bypass` and `thread` are the exchange's fields, which its compiled hooks read.
    """

    # Slots, not a __dict__: the attribute stores of a run are then the interpreter's fast
    # slot stores whatever their number (an instance dict whose shared keys fill up exactly
    # made every store about 3x slower on 3.11, measured). The exchange's fields are its own.
    __slots__ = (
        "state", "mediators", "handles", "taps", "tapped", "overrides", "skips", "cut_short",
        "extensions", "cleanups", "observers", "participants", "serving", "total",
        "stopped", "failure", "stopper", "last_write", "shared", "skipped", "reusable",
        "layouts", "learner", "dim", "copies", "expanded", "model_failed", "together",
    )

    def __init__(self, state):
        super().__init__(_is_grad_enabled, _set_grad_enabled, getcurrent=getcurrent)
        # `backward` and `axes` (below) are the exchange's fields too: with `row_type`, the
        # compiled read takes `narrowed`'s common case itself
        self.row_type = Tensor
        self.state = state  # the model's ModelState (locations, learned order)
        # Containers a run fills; its teardown leaves them empty (the engine reuses this
        # object for the model's next run, see `reset`).
        self.mediators = []
        # What the run installs (hooks.py), kept by its compiled tapper (hotpath.Taps):
        self.tapper = hotpath.Taps(state, hooks.GLOBAL_HOOKS, hooks.DIRECT_HOOKS)
        self.handles = self.tapper.handles  # key -> hook token, or None for a key a Tap fires
        self.taps = self.tapper.taps  # module index -> its Tap for this run
        self.tapped = self.tapper.tapped  # module index -> (its instance dict, forward before, or UNSET)
        self.overrides = {}  # module index -> (module, previous instance forward or missing)
        self.skips = {}  # module index -> list of (rows, value) for the current occurrence
        self.cut_short = []  # (message, filename, lineno) warned at the end
        self.extensions = {}  # per-run state of features built on this engine (source.py)
        self.cleanups = []  # callables that undo what those features installed, run at teardown
        self.observers = {}  # key -> [fn(occ, value)]: see post-edit values (cache.py)
        # Participants in the run's control flow (sharing.Sharing, barrier.Holds): see `join`.
        self.participants = []
        self.reset()

    def reset(self, backward=False):
        """Ready for a new run: the per-run fields. The engine keeps one idle interleaver per
        model and resets it for the next run instead of building one per trace (a trace's
        fixed cost); only one whose teardown completed (`reusable`) is kept."""
        self.backward = backward  # a body uses `with loss.backward():` (see grads.py)
        self.serving = None  # the event being handed over (kept if a body fails or stops there)
        self.total = None  # batch rows when several invokes share the pass
        self.stopped = False
        self.failure = None
        self.stopper = None
        self.last_write = None  # (location, filename, lineno) of the body's latest assignment
        self.shared = None  # Sharing: invokes' variables (sharing.py), when they share any
        self.skipped = False  # a skip changes which modules run: do not learn that order
        # `done` (the model call is over), `root_call` (the run is one call of the root: its
        # events are fired by hand) and `pool` are the exchange's, set by `begin`.
        self.reusable = False  # set by a teardown that emptied every per-run container
        # Batched runs (batching.py): each leaf's batch axis from the probe's signatures
        # (key -> leaves), the inputs' batch dim, the shared values served as copies
        # [(mediator, event, [(leaf, original, copy, version)])], and what the engine needs
        # to decide on running the items alone after a failure.
        self.layouts = None
        self.learner = None  # axes.Learner: the model's first batched run is followed
        self.dim = 0
        self.copies = []
        self.axes = {}  # (key, shape) -> a tensor's batch axis in this run (batching.narrow)
        self.expanded = False  # an item's edit gave a shared value a batch axis
        self.model_failed = False  # the model (not a body) raised
        self.together = False  # bodies shared variables or waited at a barrier

    # -- building -----------------------------------------------------------------------

    def add(self, fn, rows=None, label="trace body"):
        """A mediator for body `fn` (seeing batch `rows`, None: all), after the others."""
        self.add_all((fn,), (rows,), (label,))
        return self.mediators[-1]

    def add_all(self, fns, rows, labels):
        """`add(fn, rows, label)` for each body of `fns` in order, with its rows and label
        (one call for a batch of invokes or sweep items)."""
        mediators = self.mediators
        generator = routes.GENERATOR
        if len(fns) > 1 and _one_generator_route(fns):
            # every body has the same generator route (a sweep's items): no step per body
            mediators.extend(map(GeneratorMediator, fns, itertools.count(len(mediators)), rows,
                                 labels))
            return
        for fn, part, label in zip(fns, rows, labels):
            # which way the body runs (routes.py): the common cases without a call
            block = getattr(fn, "route_block", None)
            if block is None:
                cls = Mediator
            elif block.route is generator:
                cls = GeneratorMediator
            else:
                cls = routes.mediator_class(fn)
            mediators.append(cls(fn, len(mediators), part, label))

    # -- running (model side) -------------------------------------------------------------

    def run(self, call, args=(), kwargs=None, root_call=False):
        """Run `call(*args, **kwargs)` (normally the model) with the mediators interleaved.

        `root_call=True` says `call` is one plain call of the root module: its input and output
        are then handed over around the call, without hooks on the root (whose slow call path
        would cost every trace), instead of by hooks that must see every call (generation).
        The caller holds the model's turn (`Engine`): one run per model at a time.
        """
        eager = compiled.force_eager()  # torch.compile'd code runs eagerly, hooks and all
        learner = self.learner
        try:
            if learner is not None:
                learner.start(args, kwargs or {})
            if not self.backward:
                result = self._run(call, args, kwargs or {}, root_call)
            else:
                grads.install("backward")
                try:
                    result = self._run(call, args, kwargs or {}, root_call)
                finally:
                    grads.uninstall("backward")
            if learner is not None:
                self.state.layouts = learner.signatures  # learned: later runs read them
            return result
        finally:
            if learner is not None:
                self.learner = None
                learner.stop()
            if eager is not None:
                compiled.restore(eager)
            self._teardown()

    def _run(self, call, args, kwargs, root_call):
        self._setup(root_call)
        self._start()
        result = None
        if not self.stopped and self.failure is None:
            result = self._forward(call, args, kwargs, root_call)
        return self._end(result)

    # The run's phases, apart: an express run (express.py) that hands its body over to this
    # run part-way enters at the phase it had reached.

    def _setup(self, root_call):
        """The run's hub and policy, and the hooks every run of this kind has."""
        state = self.state
        learning = state.order is None
        self.hub = hub = hotpath.Hub(state.nkeys, 0, state.visits, state.positions, learning)
        # (a body that ends goes back to this thread's idle workers without a `message`)
        self.begin(hub, threading.get_ident(), root_call, WORKERS.idle)
        # The run's policy, called by its hooks (cleared at teardown: bound methods of self).
        self.routed = self._routed
        self.message = self._message
        hub.observe(state.result_key)
        if root_call:
            hub.observe(0)
            hub.observe(1)
        if learning:
            for key in range(state.result_key):
                hooks.install(self, key)
        elif not root_call:
            hooks.install(self, 0)

        mediators = self.mediators
        if len(mediators) > 1 and shares(mediators):
            self.shared = Sharing(mediators)
            self.join(self.shared)

    def _forward(self, call, args, kwargs, root_call):
        """The model call and its result handed over (`tracer.result`): the model's return
        value as the bodies left it; None when a body failed or stopped the run."""
        try:
            if root_call:
                if self.learner is not None:
                    self.learner.record(0, (args, kwargs))
                replaced = self.hook_event(0, True, args, kwargs)
                if replaced is not None:
                    args, kwargs = replaced
                result = call(*args, **kwargs)
                replaced = self.hook_event(1, False, args, result)
                if replaced is not None:
                    result = replaced
            else:
                result = call(*args, **kwargs)
        except (_Abort, _Stop):
            return None
        except Exception as error:
            self._model_raised(error)
            raise
        return self._hand_result(result)

    def _root_returned(self, args, result):
        """`_forward` after the root's call returned `result` (an express run's call)."""
        try:
            replaced = self.hook_event(1, False, args, result)
        except (_Abort, _Stop):
            return None
        except Exception as error:
            self._model_raised(error)
            raise
        return self._hand_result(result if replaced is None else replaced)

    def _model_raised(self, error):
        self.model_failed = True
        note_last_write(error, self.state, self.last_write)

    def _hand_result(self, result):
        """The model call is over: learn its order (a first run), hand its result over."""
        state = self.state
        hub = self.hub
        if hub.record is not None and not self.skipped:
            state.learn(hub.record)
        if state.order is not None:
            hub.position = len(state.order)  # the call is over: all of it has passed
        if self.learner is not None:
            self.learner.record(state.result_key, result)
        try:
            event = self.deliver(state.result_key, hub.fire(state.result_key), result)
        except (_Abort, _Stop):
            event = self.serving  # a body failed or stopped there: keep its edits
        if event is not None and event.replaced:
            result = event.value
        return result

    def _end(self, result):
        """The model call is over: end the bodies still waiting, raise a body's error."""
        self.done = True
        if self.failure is None and (self.hub.nparked or self.stopper is not None or self.participants):
            self._finish_parked()
        failure = self.failure
        if failure is None and not all(map(operator.is_, map(_ERROR, self.mediators), itertools.repeat(None))):
            for mediator in self.mediators:
                if mediator.error is not None:
                    failure, mediator.error = mediator.error, None
                    break
        if failure is not None:
            self.failure = None
            try:
                raise failure
            finally:
                failure = None  # this frame is in its traceback: no cycle through a local
        return result

    def _start(self):
        """Run each body, in invoke order, until its first request (or its end): the loop is
        the exchange's (`start_all`); `_started` is what it reports."""
        self.start_all(self.mediators)

    def _started(self, mediator, message):
        """`mediator`'s body came back from its start with `message`."""
        if type(message) is attach.WatchedCall:
            message = attach.serve(self, mediator, message, None)
        if message == FAILED or message == STOPPED:
            self._handle(mediator, message)
        if self.stopped or self.failure is not None:
            return
        if self.participants:
            try:
                self._wake(mediator, None)
            except (_Abort, _Stop):
                pass  # a body it resumed failed or stopped: recorded by `_handle`

    def _end_with(self, mediator, signal):
        """Throw `signal` into a parked body; if it catches it and asks again, cancel it."""
        self.current = mediator
        try:
            message = mediator.resume(signal)
        finally:
            self.current = None
        if message == PARKED or message == STOPPED:
            mediator.cancel()  # nothing more can come for it

    def _finish_parked(self):
        """The run is over: every body still waiting learns why (error, cut short, stop)."""
        if not self.hub.nparked and self.stopper is None and not self.participants:
            return
        self._finish_participants()
        hub = self.hub
        waiting = [(None, None, self.stopper)] if self.stopper is not None else []
        waiting += hub.drain()
        for key, occ, mediator in waiting:
            if mediator.finished:
                continue
            if self.stopped:
                signal = StopSignal()
            elif mediator.pointer.depth > 0:
                message = self._cut_short_message(key, occ)
                if not getattr(mediator.fn, "quiet", False):  # an edit's loop ends quietly
                    self.cut_short.append((message, *_user_line(mediator)))
                signal = IterationCutShort(message)
            else:
                signal = OutOfOrderError(self._never_message(key, occ))
            self._end_with(mediator, signal)
        self._finish_participants()
        for message, filename, lineno in self.cut_short:
            warnings.warn_explicit(IterationCutShortWarning(message), IterationCutShortWarning,
                                   filename, lineno)

    def _finish_participants(self):
        """End the waits of the participants' bodies (`finish`), until none waits."""
        participants = self.participants
        ending = True
        while ending:
            ending = False
            for participant in participants:
                for mediator, signal in participant.finish(self):
                    ending = True
                    if not mediator.finished:
                        self._end_with(mediator, signal)

    def _handle(self, mediator, message):
        if message == FAILED:
            self.failure = mediator.error
            mediator.error = None
        elif message == STOPPED:
            self.stopped = True
            self.stopper = mediator

    # -- the exchange's policy (model side, called by its hooks) ----------------------------

    def _routed(self, key, occ, value):
        return hooks.routed(self, key, occ, value)

    def _message(self, mediator, message, event):
        """A body served `event` came back with anything but PARKED."""
        if type(message) is attach.WatchedCall:  # it calls an attachment (attach.py)
            message = attach.serve(self, mediator, message, event)
            if message == PARKED:
                return
        if message == DONE:  # the common case (every sweep item ends so)
            mediator._release()
            return
        if message == FAILED:
            mediator._release()
        self.serving = event  # a body failed or stopped here: its edits are kept
        self._handle(mediator, message)
        if message == FAILED:
            raise _Abort()
        raise _Stop()

    def _paused(self, mediator, event):
        if self.copies:
            self._check_copies(mediator)
        if self.participants:
            self._wake(mediator, event)

    def _check_copies(self, mediator):
        """`mediator` paused or ended: a shared value it edited in place (its own copy, see
        `_part`) becomes its rows of a batched value, the other rows keeping the original."""
        kept = []
        for record in self.copies:
            owner, event, shared = record
            if owner is not mediator:
                kept.append(record)
                continue
            for index, original, copy, version in shared:
                if copy._version == version:
                    continue
                current = leaf(event.value, index)
                try:
                    if current is original:
                        batched = expand(original, mediator.rows, copy, self.total, self.dim)
                        event.value = map_leaves(
                            event.value, lambda i, t: batched if i == index else t)
                        event.replaced = True
                    else:  # an earlier item's edit batched it already
                        put(current, mediator.rows, copy, self.dim)
                except RunAlone as signal:
                    raise self._alone(signal, event.key, mediator) from None
                self.expanded = True
        self.copies = kept

    def _resume(self, mediator, event, payload=None):
        message = self.resume(mediator, event, payload)
        if message != PARKED:
            self._message(mediator, message, event)

    def _wake(self, mediator, event):
        """`mediator` paused or ended: each participant hears of it (`paused`), and the bodies
        they let go (`ready`) are resumed, each heard of in turn, until none is ready."""
        participants = self.participants
        for participant in participants:
            participant.paused(self, mediator)
        progress = True
        while progress:
            progress = False
            for participant in participants:
                for waiter, payload in participant.ready(self):
                    progress = True
                    if self.failure is None and not self.stopped and not waiter.finished:
                        self._resume(waiter, event, payload)
                        for other in participants:
                            other.paused(self, waiter)

    def _teardown(self):
        if not all(map(_FINISHED, self.mediators)):
            for mediator in self.mediators:
                if not mediator.finished:
                    mediator.cancel()
        if self.handles or self.overrides:
            hooks.remove(self)
        if self.cleanups:
            cleanups, self.cleanups = self.cleanups, []
            for cleanup in reversed(cleanups):
                cleanup()
        if self.extensions:
            self.extensions = {}
        if self.skips:
            self.skips.clear()
        self.end()
        self.routed = self.message = None
        self.serving = self.stopper = self.shared = self.failure = None
        self.mediators = []
        if self.copies:
            self.copies = []
        if self.cut_short:
            self.cut_short = []
        if self.observers:
            self.observers = {}
        if self.participants:
            self.participants = []
        self.reusable = True

    # -- variables shared between invokes (body side; see sharing.py) ---------------------------

    def assigned_earlier(self, name):
        """Body side: does an invoke before the current one assign `name`?"""
        mediator = self.current
        return (mediator is not None and self.shared is not None
                and self.shared.assigned_earlier(name, mediator))

    def shared_value(self, name, default):
        """Body side: `name` as an earlier invoke bound it, waiting for that invoke if it has
        not bound it yet; `default` when no earlier invoke binds it."""
        mediator = self.current
        shared = self.shared
        if mediator is None or shared is None:
            return default
        return shared.value(self, name, mediator, default)

    # -- observers (cache.py) ------------------------------------------

    def observe(self, key, fn):
        """Body side: call `fn(occ, value)` at every occurrence of `key` from now on, with the
        value as the model passes it on (after every body waiting there was served)."""
        self.observers.setdefault(key, []).append(fn)
        hooks.install(self, key)
        self.route(key)

    def notify(self, key, value):
        """Model side (a hook): the observers of `key` see its latest occurrence's value."""
        fns = self.observers.get(key)
        if fns:
            occ = self.hub.counts[key] - 1  # the occurrence just fired (hooked keys count exactly)
            for fn in fns:
                fn(occ, value)

    # -- participants in the run's control flow (sharing.py, barrier.py) -----------------------

    def join(self, participant):
        """`participant` takes part in this run until its teardown. Whenever a body pauses or
        ends the run calls `participant.paused(interleaver, mediator)`, then resumes the
        bodies `participant.ready(interleaver)` lets go, as `(mediator, payload)` (payload:
        None, or an error to raise in the body); when the model run is over, it ends the
        bodies `participant.finish(interleaver)` gives, as `(mediator, signal)`. A body a
        participant holds waits with `mediator.event = None; mediator.wait(PARKED)`.
        A run with no participant pays nothing for them."""
        self.participants.append(participant)
        self.paused = self._paused
        self.together = True

    # -- added locations (source.py) ----------------------------------------------------------

    def add_locations(self, owner, names, within=None):
        """Keys for locations without a module hook (see `ModelState.add_locations`).

        They are counted exactly from now on in this run; their events are fired by whoever
        added them, through `handoff`. `within` is the key of the module input they happen
        inside: it is hooked, so that while they fire the position in the learned order
        (what "already passed" is derived from for unhooked modules) is current.
        """
        if within is not None:
            hooks.install(self, within)
        state = self.state
        base = state.add_locations(owner, names)
        self.grow(state.nkeys, state.visits, state.positions)
        hub = self.hub
        for key in range(base, base + len(names)):
            hub.observe(key)
        return base

    def handoff(self, key, value):
        """Model side: location `key` happens with `value`; the value, as bodies left it."""
        event = self.deliver(key, self.hub.fire(key), value)
        return value if event is None else event.value

    # -- requests (body side) ---------------------------------------------------------------

    def mediator(self, what="this value"):
        """The mediator running the calling code; an error when called from anywhere else.

        `what` names the request for the error message: a string, or a location key.
        """
        mediator = self.current
        if mediator is None or not runs_here(mediator):
            if type(what) is int:
                what = self.state.key_name(what)
            if self.enclosing() is not None:
                raise InterlaceError(
                    f"{what} was read in the body of a trace of another model, nested in the "
                    f"body that traces this one: this model's run waits for the inner trace "
                    f"to end, so nothing of it can be handed over there; read it in the outer "
                    f"body, before or after the inner `with` block"
                )
            raise InterlaceError(
                f"{what} can only be read inside the body of the `with model.trace(...)` "
                f"block that is running it (not from another thread or after the block)"
            )
        return mediator

    def enclosing(self):
        """The mediator whose body runs the calling code, directly or through traces of other
        models nested in it (a nested run's bodies are greenlets whose parent is the greenlet
        that runs that model: the outer body); None anywhere else (another thread too)."""
        mediator = self.current
        if mediator is None or not runs_within(mediator):
            return None
        return mediator

    # `request(key, mediator=None)` and `read(key)` are the exchange's (compiled natively):
    # the common case as mechanism; these three are their policy, called only when needed.

    def refuse(self, key, occ, passed, event):
        """A request the run cannot serve: it is over, or that occurrence has passed."""
        if self.done:
            raise OutOfOrderError(
                f"{self.state.key_name(key)} (occurrence {occ}) was requested after the model "
                f"run had finished; read every value inside the trace body, while it runs"
            )
        raise OutOfOrderError(self._passed_message(key, occ, passed, event))

    def install_by_policy(self, key):
        """Hook `key` where the compiled tapper could not (`hooks.install`'s second half)."""
        hooks.install_by_policy(self, key)

    def narrowed(self, event, mediator, key):
        """`mediator`'s rows of `event`'s value (a read by an invoke or a sweep item); a leaf
        the batch shares comes as a copy of its own (an in-place edit then stays the item's:
        `_check_copies`). The exchange's reads take the common case themselves (a tensor
        whose batch axis this run cached as 0: `row_type`) and call this for the rest."""
        layouts = self.layouts
        shared = []
        try:
            # the axes are cached per run, except while the first batched run learns them
            value = narrow(event.value, mediator.rows, self.total,
                           layouts.get(key) if layouts else None, self.dim, shared,
                           self.axes if self.learner is None else None, key, self.backward)
        except RunAlone as signal:
            raise self._alone(signal, key, mediator) from None
        if shared:
            self.copies.append((mediator, event, shared))
            self.paused = self._paused
        return value

    def _alone(self, signal, key, mediator):
        """`signal` (RunAlone) completed with the location, the body's label and line."""
        signal.key = key
        signal.label = mediator.label
        frame = user_frame(sys._getframe(1))
        signal.where = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None
        return signal

    def write(self, key, value):
        mediator = self.current
        if mediator is None or mediator.worker is not getcurrent():
            mediator = self.mediator(key)  # raises: not called from the running body
        self._written(mediator, self.request(key, mediator), key, value)

    def _written(self, mediator, event, key, value):
        """`write`'s work once `event` is served: the body's value replaces its rows."""
        frame = user_frame(sys._getframe(2))
        if frame is not None:
            self.last_write = (key, frame.f_code.co_filename, frame.f_lineno)
        if mediator.rows is not None:
            layouts = self.layouts
            expanded = []
            try:
                value = swap(event.value, value, mediator.rows, self.total,
                             layouts.get(key) if layouts else None, self.dim, expanded)
            except RunAlone as signal:
                raise self._alone(signal, key, mediator) from None
            if expanded:
                self.expanded = True
        event.value = value
        event.replaced = True

    # -- requests of a generator body (routes.py): each waits by yielding PARKED ------------

    def generator_read(self, key, value=_READ):
        """`read(key)` for a body running as a generator (or its audit): a generator that
        yields PARKED while the value is not there yet, and returns it; with `value`,
        `write(key, value)` the same way (see `generator_write`)."""
        mediator = self.mediator(key)  # (raises: not the running body)
        event = self.prepare(mediator, key)
        if event is None:
            payload = yield PARKED
            if payload is not None:
                mediator.received(payload)  # raises the signal or error it is
            event = mediator.event
        if value is not _READ:
            self._written(mediator, event, key, value)
            return None
        if mediator.rows is None:
            return event.value
        return self.narrowed(event, mediator, key)

    def generator_write(self, key, value):
        """`write(key, value)` for a body running as a generator (see `generator_read`)."""
        return self.generator_read(key, value)

    def skip(self, index, value):
        """Body side: module `index` does not run at the bound occurrence; `value` is its output."""
        mediator = self.mediator(f"{self.state.paths[index]}.skip()")
        if mediator.rows is None and len(self.mediators) == 1:
            hooks.override_forward(self, index)
        hooks.install(self, 2 * index + 1)
        self.route(2 * index + 1)  # its post-hook applies the pending skip (hooks.routed)
        self.request(2 * index, mediator)
        self.skips.setdefault(index, []).append((mediator.rows, value))
        self.skipped = True

    def stop(self):
        """Body side: end the forward pass here; the body ends too, keeping what it saved."""
        mediator = self.mediator("tracer.stop()")
        mediator.wait(STOPPED)
        raise StopSignal()

    def call_plain(self, module, args, kwargs):
        """A submodule called directly inside a body runs as a plain module (no hooks fire)."""
        self.bypass += 1
        try:
            return module(*args, **kwargs)
        finally:
            self.bypass -= 1

    # -- messages ---------------------------------------------------------------------------

    def _where(self, event):
        if event is not None:
            return f"the model is at {self.state.key_name(event.key)} (occurrence {event.occ})"
        hub = self.hub
        order = self.state.order
        if order is not None and hub.calls and hub.position >= 0:
            return f"the model is at or after {self.state.key_name(order[hub.position])}"
        return "the model has not started yet"

    def _passed_message(self, key, occ, passed, event):
        name = self.state.key_name(key)
        return (
            f"{name} (occurrence {occ}) was requested after the model had already produced it "
            f"({passed} occurrence(s) so far; {self._where(event)}). Values must be requested "
            f"in the order the model computes them: read {name} earlier in the body. "
            f"Module order: {self.state.ran_summary(self.hub.record)}"
        )

    def _never_message(self, key, occ):
        name = self.state.key_name(key)
        count = self.hub.so_far(key)
        if self.stopped:
            why = "the run was stopped by tracer.stop() before it"
        elif count:
            why = f"the run ended after {count} occurrence(s) of it (0..{count - 1})"
        else:
            why = "it never ran in this run"
        return (
            f"{name} (occurrence {occ}) was never produced: {why}. "
            f"Modules that ran, in order: {self.state.ran_summary(self.hub.record)}"
        )

    def _cut_short_message(self, key, occ):
        name = self.state.key_name(key)
        count = self.hub.so_far(key)
        return (
            f"tracer.iter loop cut short: step {occ} of {name} was never reached (the run "
            f"produced {count} occurrence(s)); values saved in earlier steps are kept and the "
            f"code after the loop did not run. To make a generation run for the loop's count, "
            f"pass min_new_tokens= (transformers) along with max_new_tokens="
        )
