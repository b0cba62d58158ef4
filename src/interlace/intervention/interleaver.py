"""The interleaver: runs a model once while its mediators read and edit values as they appear.

Policy (this file) on top of mechanism (`interlace._native.hotpath`):

- Only locations some body asked for are hooked, at the moment it asks (the model has not
  reached them yet, or the request is out of order anyway). The root's input is always
  hooked: it counts root calls (generation calls the root once per step).
- The first trace of a model hooks every module and records the order of locations in one
  root call (`ModelState.learn`). Later traces derive the count of unhooked locations from
  it, which is what makes "already passed" detectable and `OutOfOrderError` precise.
- Everything installed (hooks, forward overrides) belongs to the run and is removed in
  `finally`; parked bodies are unwound; the per-model lock is released (two threads tracing
  one model take turns on it).
- With several invokes, a body's variables are published whenever it pauses; a later
  invoke reading a name only an earlier one assigns waits for it (see `tracer.Invoker`).

Known limit: the learned order assumes every root call visits modules in the same order.
A model whose module order depends on its input can get a false "already produced" from a
request the learned order places earlier than it really runs.
"""

from __future__ import annotations

import sys
import threading
import weakref
import warnings

import torch
from greenlet import getcurrent
from torch.utils.hooks import RemovableHandle

from .._native import hotpath
from ..errors import InterlaceError, IterationCutShortWarning, OutOfOrderError
from . import compiled, grads
from .batching import narrow, swap
from .mediator import (
    DONE,
    FAILED,
    PARKED,
    STOPPED,
    IterationCutShort,
    Mediator,
    StopSignal,
)

_MISSING = object()
_WAIT = object()

# Hooks go straight into the module's hook dicts, exactly as `register_forward_(pre_)hook`
# puts them there, minus the `RemovableHandle` and its weakrefs (a third of a trace's hook
# cost). Ids come from torch's own counter so they never collide with anybody's handle.
_DIRECT_HOOKS = all(
    hasattr(torch.nn.Module(), name)
    for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks")
)


def _attach(module, hook, pre):
    """Install `hook` on `module` (a with-kwargs pre-hook, or a forward hook); returns a token."""
    if not _DIRECT_HOOKS:
        if pre:
            return module.register_forward_pre_hook(hook, with_kwargs=True)
        return module.register_forward_hook(hook)
    hid = RemovableHandle.next_id
    RemovableHandle.next_id = hid + 1
    if pre:
        module._forward_pre_hooks[hid] = hook
        module._forward_pre_hooks_with_kwargs[hid] = True
        return (hid, module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs)
    module._forward_hooks[hid] = hook
    return (hid, module._forward_hooks)


def _detach(token):
    if type(token) is not tuple:
        token.remove()
        return
    hid = token[0]
    for hooks in token[1:]:
        hooks.pop(hid, None)


class _Abort(BaseException):
    """Unwinds the model's forward after a body failed (the body's error is re-raised)."""


class _Stop(BaseException):
    """Unwinds the model's forward after `tracer.stop()`."""


def _user_line(mediator):
    """(filename, lineno) of the innermost frame of a parked body outside interlace."""
    frame = mediator.worker.gr_frame if mediator.worker is not None else None
    while frame is not None:
        filename = frame.f_code.co_filename
        if _PACKAGE_DIR not in filename:
            return filename, frame.f_lineno
        frame = frame.f_back
    return "<interlace>", 0


_PACKAGE_DIR = __file__.rsplit("intervention", 1)[0]


class Event:
    """One happening of a location, as handed to bodies: its value may be replaced."""

    __slots__ = ("key", "occ", "value", "replaced")

    def __init__(self, key, occ, value):
        self.key = key
        self.occ = occ
        self.value = value
        self.replaced = False


class ModelState:
    """What one wrapped model knows across traces: its locations, learned order, lock."""

    def __init__(self, root):
        self.root = root
        self.modules = []
        self.paths = []
        self.index = {}
        for name, module in root.named_modules():
            self.index[id(module)] = len(self.modules)
            self.modules.append(module)
            self.paths.append("model." + name if name else "model")
        by_path = {path: i for i, path in enumerate(self.paths)}
        # ancestors[i]: the modules that contain module i and are themselves called (root and
        # containers without a forward of their own, ModuleList/ModuleDict, excluded)
        callable_ = [type(m).forward is not torch.nn.Module.forward for m in self.modules]
        self.ancestors = []
        for path in self.paths:
            parts = path.split(".")
            chain = (by_path.get(".".join(parts[:j])) for j in range(2, len(parts)))
            self.ancestors.append(tuple(i for i in chain if i is not None and callable_[i]))
        n = len(self.modules)
        self.nkeys = 2 * n + 1
        self.result_key = 2 * n
        self.order = None  # key ids of one root call, learned on the first trace
        self.visits = None
        self.positions = None
        self.lock = threading.Lock()
        self.owner = None  # thread ident of the running trace
        self.active = None  # the running Interleaver
        self.collecting = False  # a trace without inputs is running its body to find invokes
        # Locations beyond the modules (operations inside a forward, see source.py) get keys
        # above result_key, allocated on first use and stable for the model's life.
        self.extra = {}  # owner -> first key of its block
        self.extra_names = []
        # The Envoy of each module index, weakly (the root's tree owns them): one Envoy per
        # module even when two paths reach it. Aliases (rename=): {envoy path: {alias: path}}.
        self.envoys = weakref.WeakValueDictionary()
        self.aliases = {}
        self.envoy_classes = None  # Model(..., envoys=): which Envoy class wraps which module

    def add_locations(self, owner, names):
        """The first of `len(names)` keys for locations `owner` adds (the same keys every time)."""
        base = self.extra.get(owner)
        if base is None:
            base = self.extra[owner] = self.nkeys
            self.extra_names.extend(names)
            self.nkeys += len(names)
            if self.visits is not None:  # never in the learned order: derived counts are 0
                self.visits += (0,) * len(names)
                self.positions += ((),) * len(names)
        return base

    def key_name(self, key):
        if key == self.result_key:
            return "tracer.result"
        if key > self.result_key:
            return self.extra_names[key - self.result_key - 1]
        return f"{self.paths[key >> 1]}.{'output' if key & 1 else 'input'}"

    def learn(self, record):
        """Keep the order of locations of the first root call seen in `record`."""
        root_in = 0
        starts = [i for i, key in enumerate(record) if key == root_in]
        if not starts:
            return
        end = starts[1] if len(starts) > 1 else len(record)
        order = tuple(k for k in record[starts[0]:end] if k < self.result_key)
        positions = [[] for _ in range(self.nkeys)]
        for i, key in enumerate(order):
            positions[key].append(i)
        self.positions = tuple(tuple(p) for p in positions)
        self.visits = tuple(len(p) for p in positions)
        self.order = order

    def ran_summary(self, record=None, limit=12):
        """The modules of one root call in the order they finish (for error messages)."""
        order = self.order if self.order is not None else record
        if not order:
            return "unknown (the module order has not been learned yet)"
        names = [self.paths[k >> 1] for k in order if k & 1 and k < self.result_key]
        more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more


def _invoke_order(mediator):
    return mediator.index


class Interleaver:
    """One run of a model with its mediators (one per body / invoke)."""

    def __init__(self, state: ModelState, backward=False):
        self.state = state
        self.backward = backward  # a body uses `with loss.backward():` (see grads.py)
        self.mediators = []
        self.hub = None
        self.handles = {}
        self.overrides = {}  # module index -> (module, previous instance forward or _MISSING)
        self.skips = {}  # module index -> list of (rows, value) for the current occurrence
        self.current = None
        self.total = None  # batch rows when several invokes share the pass
        self.thread = None
        self.done = False
        self.stopped = False
        self.failure = None
        self.bypass = 0
        self.cut_short = []  # (message, filename, lineno) warned at the end
        self.stopper = None
        self.last_write = None  # (location, filename, lineno) of the body's latest assignment
        self.shared = None  # per invoke: its variables, by name, as of its last pause
        self.name_waiters = []  # (name, mediator): bodies waiting for an earlier invoke's variable
        self.skipped = False  # a skip changes which modules run: do not learn that order
        self.root_call = False  # the run is one call of the root: its events are fired by hand
        self.extensions = {}  # per-run state of features built on this engine (source.py)
        self.cleanups = []  # callables that undo what those features installed, run at teardown
        self.observers = {}  # key -> [fn(occ, value)]: see post-edit values (cache.py)
        self.held = {}  # mediator -> what holds it (a Barrier, barrier.py), until released
        self.released = []  # held bodies let go: resumed when the body running now pauses

    # -- building -----------------------------------------------------------------------

    def add(self, fn, rows=None, label="trace body"):
        mediator = Mediator(fn, len(self.mediators), rows, label)
        self.mediators.append(mediator)
        return mediator

    # -- running (model side) -------------------------------------------------------------

    def run(self, call, args=(), kwargs=None, root_call=False):
        """Run `call(*args, **kwargs)` (normally the model) with the mediators interleaved.

        `root_call=True` says `call` is one plain call of the root module: its input and output
        are then handed over around the call, without hooks on the root (whose slow call path
        would cost every trace), instead of by hooks that must see every call (generation).
        """
        self.root_call = root_call
        state = self.state
        me = threading.get_ident()
        if not state.lock.acquire(blocking=False):
            if state.owner == me:
                raise InterlaceError(
                    "this model is already being traced in this thread: a trace of the same "
                    "model cannot start inside another one's body; trace it after the outer "
                    "block, or wrap a second copy of the module"
                )
            state.lock.acquire()
        state.owner = me
        state.active = self
        self.thread = me
        eager = compiled.force_eager()  # torch.compile'd code runs eagerly, hooks and all
        try:
            if not self.backward:
                return self._run(call, args, kwargs or {})
            grads.install("backward")
            try:
                return self._run(call, args, kwargs or {})
            finally:
                grads.uninstall("backward")
        finally:
            compiled.restore(eager)
            try:
                self._teardown()
            finally:
                state.active = None
                state.owner = None
                state.lock.release()

    def _run(self, call, args, kwargs):
        state = self.state
        learning = state.order is None
        self.hub = hub = hotpath.Hub(state.nkeys, 0, state.visits, state.positions, learning)
        hub.observe(state.result_key)
        if self.root_call:
            hub.observe(0)
            hub.observe(1)
        if learning:
            for key in range(state.result_key):
                self._hook(key)
        else:
            self._hook(0)

        # invokes share variables (bodies with `assigns`; a model's edits have none)
        if len(self.mediators) > 1 and sum(
                getattr(m.fn, "assigns", None) is not None for m in self.mediators) > 1:
            self.shared = [{} for _ in self.mediators]
        for mediator in self.mediators:
            self.current = mediator
            try:
                message = mediator.start()
            finally:
                self.current = None
            self._handle(mediator, message)
            if self.stopped or self.failure is not None:
                break
            if self.shared is not None or self.held or self.released:
                try:
                    self._share(mediator, None)
                except (_Abort, _Stop):
                    pass  # a body it resumed failed or stopped: recorded by `_handle`
                if self.stopped or self.failure is not None:
                    break
        aborted = stopped = False
        result = None
        if not self.stopped and self.failure is None:
            try:
                if self.root_call:
                    root = state.root
                    replaced = self._pre(0)(root, args, kwargs)
                    if replaced is not None:
                        args, kwargs = replaced
                    result = call(*args, **kwargs)
                    replaced = self._post(1)(root, args, result)
                    if replaced is not None:
                        result = replaced
                else:
                    result = call(*args, **kwargs)
            except _Abort:
                aborted = True
            except _Stop:
                stopped = True
            except Exception as error:
                if self.last_write is not None and hasattr(error, "add_note"):
                    key, filename, lineno = self.last_write
                    error.add_note(
                        f"interlace: the trace body set {state.key_name(key)} at "
                        f"{filename}:{lineno} before "
                        f"the model raised this; check the value assigned there"
                    )
                raise
            if not aborted and not stopped:
                if learning and not self.skipped:
                    state.learn(hub.record)
                if state.order is not None:
                    hub.position = len(state.order)  # the call is over: all of it has passed
                key = state.result_key
                occ = hub.fire(key)
                waiters = hub.take(key, occ)
                if waiters is not None:
                    event = Event(key, occ, result)
                    try:
                        self._serve(event, waiters)
                    except _Abort:
                        aborted = True
                    except _Stop:
                        pass
                    if event.replaced:
                        result = event.value
        self.done = True
        if self.failure is None:
            self._finish_parked()
        failure = self.failure
        if failure is None:
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
        if (not self.name_waiters and not self.hub.nparked and self.stopper is None
                and not self.held and not self.released):
            return
        for name, mediator in self.name_waiters:
            if not mediator.finished:
                signal = StopSignal() if self.stopped else NameError(
                    f"name {name!r} is not defined: the earlier invoke that assigns it never "
                    f"got there before the run ended"
                )
                self._end_with(mediator, signal)
        self.name_waiters = []
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
        while self.held or self.released:  # barriers (barrier.py)
            while self.released:
                mediator = self.released.pop(0)
                if not mediator.finished:
                    self._end_with(mediator, None)  # a request now says the run has ended
            held = list(self.held.items())
            self.held = {}
            signals = [StopSignal() if self.stopped else holder.never_filled(self, mediator)
                       for mediator, holder in held]
            for (mediator, holder), signal in zip(held, signals):
                holder.drop(mediator)
                if not mediator.finished:
                    self._end_with(mediator, signal)
        for message, filename, lineno in self.cut_short:
            warnings.warn_explicit(IterationCutShortWarning(message), IterationCutShortWarning,
                                   filename, lineno)

    def _handle(self, mediator, message):
        if message == FAILED:
            self.failure = mediator.error
            mediator.error = None
        elif message == STOPPED:
            self.stopped = True
            self.stopper = mediator

    def _serve(self, event, waiters):
        """Hand `event` to each waiting body in turn, in invoke order (model side, in a hook)."""
        if len(waiters) > 1:
            waiters.sort(key=_invoke_order)
        for mediator in waiters:
            self._resume(mediator, event)
            if self.shared is not None or self.held or self.released:
                self._share(mediator, event)

    def _resume(self, mediator, event, payload=None):
        self.current = mediator
        mediator.event = event
        try:
            message = mediator.resume(payload)
        finally:
            mediator.event = None
            self.current = None
        if message != PARKED and message != DONE:
            self._handle(mediator, message)
            if message == FAILED:
                raise _Abort()
            raise _Stop()

    # -- variables shared between invokes -----------------------------------------------------
    #
    # The rule (an invoke's body behaves as if it ran inline where its `with` stands): a name
    # the body reads but does not assign, which an EARLIER invoke's body assigns, is that
    # earlier body's value - the latest earlier invoke that assigns it wins, as inline. Bodies
    # publish their variables whenever they pause or end; a reader whose provider has not
    # bound the name yet waits for it (the model runs on meanwhile).

    def _share(self, mediator, event):
        """`mediator` paused or ended: publish its variables, wake bodies waiting for them
        (for a variable, or released from a barrier)."""
        if self.shared is not None:
            self._publish(mediator)
        if self.held and mediator.finished:
            self._check_held(event)
        progress = True
        while progress and (self.name_waiters or self.released):
            progress = False
            while self.released:
                waiter = self.released.pop(0)
                progress = True
                if self.failure is None and not self.stopped and not waiter.finished:
                    self._resume(waiter, event)
                    if self.shared is not None:
                        self._publish(waiter)
                    if self.held and waiter.finished:
                        self._check_held(event)
            for entry in list(self.name_waiters):
                name, waiter = entry
                if self._resolve(name, waiter) is _WAIT:
                    continue
                self.name_waiters.remove(entry)
                progress = True
                if self.failure is None and not self.stopped:
                    self._resume(waiter, event)
                    self._publish(waiter)

    def _publish(self, mediator):
        fn = mediator.fn
        assigns = getattr(fn, "assigns", None)
        if not assigns:
            return
        if mediator.finished:
            values = fn.out
        else:
            values = None
            code = fn.tracer._code
            frame = mediator.worker.gr_frame if mediator.worker is not None else None
            while frame is not None:
                if frame.f_code is code:
                    values = frame.f_locals
                    break
                frame = frame.f_back
            if values is None:
                return
        published = self.shared[mediator.index]
        if mediator.finished:
            for name in assigns:
                if name in values:
                    published[name] = values[name]
            return
        # A paused body has not necessarily assigned its names yet: one that still holds the
        # caller's value it started with is not the body's value (a reader waits for that).
        entry = fn.tracer._entry_values
        for name in assigns:
            if name in values:
                value = values[name]
                if name not in entry or entry[name] is not value:
                    published[name] = value

    def _resolve(self, name, reader):
        """What `reader` sees of `name` from earlier invokes: a value, `_MISSING` (no earlier
        invoke binds it: the caller's value or a global applies) or `_WAIT` (the latest
        earlier invoke that assigns it is still running and has not bound it yet)."""
        for provider in reversed(self.mediators[: reader.index]):
            if name not in (getattr(provider.fn, "assigns", None) or ()):
                continue
            published = self.shared[provider.index]
            if name in published:
                return published[name]
            if not provider.finished:
                return _WAIT
        return _MISSING

    def assigned_earlier(self, name):
        """Body side: does an invoke before the current one assign `name`?"""
        mediator = self.current
        return mediator is not None and self.shared is not None and any(
            name in (getattr(m.fn, "assigns", None) or ()) for m in self.mediators[: mediator.index]
        )

    def shared_value(self, name, default):
        """Body side: `name` as an earlier invoke bound it, waiting for that invoke if it has
        not bound it yet; `default` when no earlier invoke binds it."""
        mediator = self.current
        if mediator is None or self.shared is None:
            return default
        while True:
            value = self._resolve(name, mediator)
            if value is _MISSING:
                return default
            if value is not _WAIT:
                return value
            if self.done or mediator.worker is not getcurrent():
                return default  # e.g. a backward body inside the invoke: it cannot park here
            self.name_waiters.append((name, mediator))
            mediator.event = None
            mediator.wait(PARKED)

    # -- observers and holds (cache.py, barrier.py) ------------------------------------------

    def observe(self, key, fn):
        """Body side: call `fn(occ, value)` at every occurrence of `key` from now on, with the
        value as the model passes it on (after every body waiting there was served)."""
        self.observers.setdefault(key, []).append(fn)
        self._hook(key)

    def _observe(self, key, occ, value):
        fns = self.observers.get(key)
        if fns:
            for fn in fns:
                fn(occ, value)

    def hold(self, mediator, holder):
        """Body side: park `mediator` (the model runs on) until another body `release`s it.

        Whenever a body ends, `holder.hopeless(interleaver, mediator)` may return an error
        to end the wait with; if the run ends first, the body gets
        `holder.never_filled(interleaver, mediator)`; `holder.drop(mediator)` forgets it.
        """
        self.held[mediator] = holder
        mediator.event = None
        mediator.wait(PARKED)

    def release(self, mediator):
        """Body side: a held body goes on, at the model's current place, as soon as the
        calling body pauses or ends."""
        if self.held.pop(mediator, None) is not None:
            self.released.append(mediator)

    def _check_held(self, event):
        """A body ended: end the wait of held bodies that can no longer be released."""
        ended = [(m, holder, holder.hopeless(self, m)) for m, holder in self.held.items()]
        for mediator, holder, error in ended:
            if error is not None and self.held.pop(mediator, None) is not None:
                holder.drop(mediator)
        for mediator, _, error in ended:
            if error is not None and self.failure is None and not self.stopped:
                self._resume(mediator, event, error)

    # -- hooks ---------------------------------------------------------------------------

    def _hook(self, key):
        if key in self.handles or key >= self.state.result_key or (key < 2 and self.root_call):
            return  # the result, a root fired by hand, or an added location (no module hook)
        index = key >> 1
        # torch reads a module's forward hooks after its forward only on its slow path, which
        # a call takes when the module had a hook as it started. Hooking the containers of a
        # requested location before they start keeps a later request for a container's
        # output (asked while the model is inside it) servable.
        for ancestor in self.state.ancestors[index]:
            if 2 * ancestor not in self.handles:
                self._hook(2 * ancestor)
        self.hub.observe(key)
        module = self.state.modules[index]
        if key & 1:
            self.handles[key] = _attach(module, self._post(key), False)
        else:
            self.handles[key] = _attach(module, self._pre(key), True)

    def _pre(self, key):
        hub = self.hub
        observers = self.observers
        thread = self.thread
        get_ident = threading.get_ident

        def pre_hook(module, args, kwargs):
            if self.bypass or get_ident() != thread:
                return None
            occ = hub.fire(key)
            waiters = hub.take(key, occ)
            if waiters is None:
                if observers:
                    self._observe(key, occ, (args, kwargs))
                return None
            event = Event(key, occ, (args, kwargs))
            self._serve(event, waiters)
            if observers:
                self._observe(key, occ, event.value)
            if event.replaced:
                return event.value
            return None

        return pre_hook

    def _post(self, key):
        hub = self.hub
        thread = self.thread
        get_ident = threading.get_ident
        index = key >> 1
        skips = self.skips
        observers = self.observers

        def post_hook(module, args, output):
            if self.bypass or get_ident() != thread:
                return None
            occ = hub.fire(key)
            replaced = False
            if skips:
                pending = skips.pop(index, None)
                if pending is not None:
                    for rows, value in pending:
                        output = value if rows is None else swap(output, value, rows, self.total)
                    replaced = True
            waiters = hub.take(key, occ)
            if waiters is None:
                if observers:
                    self._observe(key, occ, output)
                return output if replaced else None
            event = Event(key, occ, output)
            self._serve(event, waiters)
            if observers:
                self._observe(key, occ, event.value)
            if event.replaced or replaced:
                return event.value
            return None

        return post_hook

    def _override_forward(self, index):
        """Let `skip` avoid running a module: its forward returns the pending value."""
        if index in self.overrides:
            return
        module = self.state.modules[index]
        previous = module.__dict__.get("forward", _MISSING)
        original = module.forward
        skips = self.skips

        def forward(*args, **kwargs):
            pending = skips.get(index) if not self.bypass else None
            if pending is not None and len(pending) == 1 and pending[0][0] is None:
                return pending[0][1]
            return original(*args, **kwargs)

        self.overrides[index] = (module, previous)
        module.forward = forward

    def _teardown(self):
        for mediator in self.mediators:
            if not mediator.finished:
                mediator.cancel()
        for token in self.handles.values():
            _detach(token)
        self.handles.clear()
        for module, previous in self.overrides.values():
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self.overrides.clear()
        cleanups, self.cleanups = self.cleanups, []
        for cleanup in reversed(cleanups):
            cleanup()
        self.extensions = {}
        self.skips.clear()
        self.hub = None
        self.current = None
        self.mediators = []
        self.shared = None
        self.name_waiters = []
        self.observers = {}
        self.held = {}
        self.released = []

    # -- added locations (source.py) ----------------------------------------------------------

    def add_locations(self, owner, names, within=None):
        """Keys for locations without a module hook (see `ModelState.add_locations`).

        They are counted exactly from now on in this run; their events are fired by whoever
        added them, through `handoff`. `within` is the key of the module input they happen
        inside: it is hooked, so that while they fire the position in the learned order
        (what "already passed" is derived from for unhooked modules) is current.
        """
        if within is not None:
            self._hook(within)
        state = self.state
        base = state.add_locations(owner, names)
        hub = self.hub
        missing = state.nkeys - len(hub.counts)
        if missing > 0:  # the hub indexes these unchecked: grow them before any fire
            hub.counts.extend([0] * missing)
            hub.exact.extend([True] * missing)
            if hub.visits is not None:
                hub.visits = state.visits
                hub.positions = state.positions
        for key in range(base, base + len(names)):
            hub.observe(key)
        return base

    def handoff(self, key, value):
        """Model side: location `key` happens with `value`; the value, as bodies left it."""
        hub = self.hub
        occ = hub.fire(key)
        waiters = hub.take(key, occ)
        if waiters is None:
            return value
        event = Event(key, occ, value)
        self._serve(event, waiters)
        return event.value

    # -- requests (body side) ---------------------------------------------------------------

    def mediator(self, what="this value"):
        """The mediator running the calling code; an error when called from anywhere else.

        `what` names the request for the error message: a string, or a location key.
        """
        mediator = self.current
        if mediator is None or mediator.worker is not getcurrent():
            if type(what) is int:
                what = self.state.key_name(what)
            raise InterlaceError(
                f"{what} can only be read inside the body of the `with model.trace(...)` "
                f"block that is running it (not from another thread or after the block)"
            )
        return mediator

    def request(self, key, mediator=None):
        """Body side: wait for the location `key` at the occurrence the pointer names."""
        if mediator is None:
            mediator = self.mediator(key)
        hub = self.hub
        event = mediator.event
        passed = hub.so_far(key)
        if event is not None and event.key == key:
            occ = mediator.pointer.bind(event.occ)
            if event.occ == occ:
                return event
        else:
            occ = mediator.pointer.bind(passed)
        if self.done:
            raise OutOfOrderError(
                f"{self.state.key_name(key)} (occurrence {occ}) was requested after the model "
                f"run had finished; read every value inside the trace body, while it runs"
            )
        if occ < passed:
            raise OutOfOrderError(self._passed_message(key, occ, passed, event))
        self._hook(key)
        hub.park(key, occ, mediator)
        mediator.event = None
        mediator.wait(PARKED)
        return mediator.event

    def read(self, key):
        mediator = self.mediator(key)
        event = self.request(key, mediator)
        if mediator.rows is None:
            return event.value
        return narrow(event.value, mediator.rows, self.total)

    def write(self, key, value):
        mediator = self.mediator(key)
        event = self.request(key, mediator)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            frame = frame.f_back
        if frame is not None:
            self.last_write = (key, frame.f_code.co_filename, frame.f_lineno)
        if mediator.rows is not None:
            value = swap(event.value, value, mediator.rows, self.total)
        event.value = value
        event.replaced = True

    def skip(self, index, value):
        """Body side: module `index` does not run at the bound occurrence; `value` is its output."""
        mediator = self.mediator(f"{self.state.paths[index]}.skip()")
        if mediator.rows is None and len(self.mediators) == 1:
            self._override_forward(index)
        self._hook(2 * index + 1)
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
