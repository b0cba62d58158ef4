"""Pure-Python twin of `csrc/_chotpath.pyx`: the per-event bookkeeping of one trace.

Mechanism only (policy lives in `interlace.intervention`, handed to `Exchange` as callables).
Locations are small integers (`key`), one per (module, "input"/"output") of a model. Keep
this file and the `.pyx` line-for-line equivalent: the test suite runs on both. (One
deliberate difference: the twin's hooks are `functools.partial`s of `on_hook`, not `Hook`
objects: a partial adds no Python frame; `Hook` exists here for the names to match.)

Why a learned order: only modules the body asks for are hooked (a hook on every module
costs 6-16% on a small model), so most locations are never observed. The engine learns
the sequence of locations of one root call once per model; with it, the count of any
location so far follows from the position of the last observed one.
"""

from _thread import get_ident
from _contextvars import copy_context
from _functools import partial  # (functools itself costs an import)

RELAXED = -1
POOL_MAX = 64  # idle workers kept per thread (see MediatorCore.release)
"""`Pointer.iteration` value meaning: bind each request to the next occurrence not yet passed."""


class Hub:
    """Occurrence counters, the position in the learned order, and the parked requests."""

    __slots__ = ("counts", "exact", "parked", "nparked", "calls", "position", "root",
                 "visits", "positions", "record")

    def __init__(self, nkeys, root, visits, positions, learning):
        # visits[key]: how often `key` happens per root call (learned), or None when unknown.
        # positions[key]: the indexes of those happenings in the learned order of one call.
        self.counts = [0] * nkeys
        self.exact = [bool(learning)] * nkeys
        self.parked = {}
        self.nparked = 0
        self.calls = 0
        self.position = -1
        self.root = root
        self.visits = visits
        self.positions = positions
        self.record = [] if learning else None

    def fire(self, key):
        """A hooked location happened: count it and move the position. Returns its occurrence."""
        occ = self.counts[key]
        self.counts[key] = occ + 1
        if key == self.root:
            self.calls += 1
        if self.record is not None:
            self.record.append(key)
        if self.visits is not None:
            v = self.visits[key]
            if v:
                j = occ - (self.calls - 1) * v
                if 0 <= j < v:
                    self.position = self.positions[key][j]
        return occ

    def so_far(self, key):
        """How many times `key` has happened so far in this trace (observed or derived)."""
        if self.exact[key]:
            return self.counts[key]
        if self.visits is None or self.calls == 0:
            return 0
        v = self.visits[key]
        n = (self.calls - 1) * v
        for p in self.positions[key]:
            if p <= self.position:
                n += 1
        return n

    def observe(self, key):
        """`key` is hooked from now on: its counter continues from the derived count."""
        if not self.exact[key]:
            self.counts[key] = self.so_far(key)
            self.exact[key] = True

    def park(self, key, occ, waiter):
        """Wait for occurrence `occ` of `key`; waiters of one event are served in park order."""
        by_occ = self.parked.get(key)
        if by_occ is None:
            by_occ = self.parked[key] = {}
        waiters = by_occ.get(occ)
        if waiters is None:
            by_occ[occ] = [waiter]
        else:
            waiters.append(waiter)
        self.nparked += 1

    def take(self, key, occ):
        """The waiters of (key, occ), removed from the table; None when nobody waits (fast)."""
        if not self.nparked:
            return None
        by_occ = self.parked.get(key)
        if by_occ is None:
            return None
        waiters = by_occ.pop(occ, None)
        if waiters is not None:
            self.nparked -= len(waiters)
            if not by_occ:
                del self.parked[key]
        return waiters

    def drain(self):
        """Every parked (key, occ, waiter), removed from the table (the run has ended)."""
        out = []
        for key, by_occ in self.parked.items():
            for occ, waiters in by_occ.items():
                for waiter in waiters:
                    out.append((key, occ, waiter))
        self.parked = {}
        self.nparked = 0
        return out


class Pointer:
    """A mediator's iteration pointer: which occurrence its next request binds to.

    `iteration` >= 0 binds every request to that occurrence (the default is 0: one forward
    pass); `RELAXED` binds each request to the next occurrence of its location not yet
    passed. `pin(n)` makes only the next request bind to `n`, after which the pointer is
    relaxed. `depth` counts enclosing `tracer.iter` loops. `save()`/`restore()` let loops nest.
    """

    __slots__ = ("iteration", "pinned", "depth")

    def __init__(self):
        self.iteration = 0
        self.pinned = RELAXED
        self.depth = 0

    def bind(self, upcoming):
        """The occurrence a request binds to; `upcoming` is the next one not yet passed."""
        occ = self.pinned
        if occ >= 0:
            self.pinned = RELAXED
            self.iteration = RELAXED
            return occ
        occ = self.iteration
        if occ >= 0:
            return occ
        return upcoming

    def pin(self, n):
        if n < 0:
            raise ValueError(f"iteration must be >= 0, got {n}")
        self.pinned = n

    def save(self):
        return (self.iteration, self.pinned, self.depth)

    def restore(self, state):
        self.iteration, self.pinned, self.depth = state


# -- the per-event exchange -------------------------------------------------------------------

# Messages a mediator's greenlet sends back to the side that resumed it.
PARKED = 1  # the body waits for a value (it is in the hub's table)
DONE = 2  # the body returned
FAILED = 3  # the body raised
STOPPED = 4  # the body called tracer.stop()

UNWIND_STOP = False
"""The twin has no native frame to end an unwind with (see the .pyx's `outermost`)."""


def outermost(fn):
    """Return fn(): the compiled twin calls it from a frame that ends native unwinds."""
    return fn()


def _invoke_order(mediator):
    return mediator.index


_configured = {}  # what MediatorCore.start calls (`configure`)


def configure(getcurrent, is_grad_enabled, set_grad_enabled, new_worker, idle_workers,
              enter_body=None, exit_body=None, gen_worker=None):
    """Set what `MediatorCore.start` calls: greenlet's `getcurrent`, torch's grad-mode getter
    and setter, `new_worker()` (a worker greenlet, when the pool is empty: policy) and
    `idle_workers()` (this thread's pool, when `start` is given none); and what a `GenCore`
    calls to enter a body's save state and leave it: `enter_body(state) -> token`,
    `exit_body(token)`; `gen_worker(mediator, gen, state)`, the `GenCore` subclass that
    `start_generator_job` makes."""
    _configured.update(getcurrent=getcurrent, is_grad_enabled=is_grad_enabled,
                       set_grad_enabled=set_grad_enabled, new_worker=new_worker,
                       idle_workers=idle_workers, enter_body=enter_body, exit_body=exit_body,
                       gen_worker=gen_worker)


def plain_job(cls, hidden):
    """Take in C the steps of a `cls` job (intervention.body.BodyJob) that are mechanism: its
    `generator()` and its `finish(values)` (see the compiled one). The twin calls the job's
    methods, which take the same steps."""


def configure_express(force_eager, restore, quiet_backends, close_body, stops, hidden):
    """Set what `ExpressCore.run` calls: `force_eager() -> token` and `restore(token)` (a
    compiled model runs eagerly during a run; `quiet_backends()`, after `force_eager` gave
    None, the dict whose unchanged size means it would give None again, or None: the run
    calls `force_eager` only when that size changed), `close_body(gen, context, token)` (a body
    that did not end); `stops`, the exceptions by which a failed or stopped body ends the
    forward from a wrapper; `hidden`, the names of a generator body's hidden parameters,
    dropped from its final locals (as `DeferredBody.generator_locals` drops them; the
    compiled run drops them itself, the twin's policy calls that)."""
    _configured.update(force_eager=force_eager, restore=restore, quiet_backends=quiet_backends,
                       close_body=close_body, stops=tuple(stops), hidden=tuple(hidden))
    _quiet[:] = [None, -1]


_quiet = [None, -1]  # the dict `quiet_backends()` gave when `force_eager` had nothing to do, its size


def _eager_run():
    """`force_eager()`, unless the dict it last had nothing to do for has kept its size."""
    quiet, size = _quiet
    if quiet is not None and len(quiet) == size:
        return None
    eager = _configured["force_eager"]()
    _quiet[:] = [None, -1]
    if eager is None:
        quiet = _configured["quiet_backends"]()
        if type(quiet) is dict:
            _quiet[:] = [quiet, len(quiet)]
    return eager


class MediatorCore:
    """A mediator's fields, read and written by the exchange as struct fields, not by name,
    and the start of its body (mechanism: a pooled worker, grad modes, one switch).

    `intervention.mediator.Mediator` subclasses it. A subclass must not list these names in
    its own `__slots__`: a slot of the same name would hide the field, and the exchange would
    go on reading the field while Python code writes the slot.
    """

    __slots__ = ("index", "rows", "pointer", "worker", "event", "body_grad", "finished",
                 "fn", "error", "label", "parks")

    def __init__(self, fn=None, index=0, rows=None, label="trace body"):
        self.fn = fn
        self.index = index
        self.rows = rows
        self.pointer = Pointer()
        self.worker = None
        self.event = None
        self.error = None
        self.finished = False
        self.body_grad = None
        self.label = label
        self.parks = 0  # waits through `wait_for` (a greenlet body's), counted

    def start(self, pool=None):
        """Run the body (the subclass's `_job`) on a worker from `pool` (default: this
        thread's idle workers) until its first request or its end; returns its message.
        The body starts in the model's grad mode, and the model gets its mode back after."""
        c = _configured
        if pool is None:
            pool = c["idle_workers"]()
        worker = pool.pop() if pool else c["new_worker"]()
        worker.parent = c["getcurrent"]()
        return self._first_switch(worker, self._job, pool)

    def start_generator(self, worker, pool=None):
        """`start` for a generator body: `worker` (made for it) runs the body until its first
        request (or its end); returns its message. Grad modes as `start`'s; an ended body is
        released to `pool`."""
        if not isinstance(worker, GenCore):
            raise TypeError(f"Argument 'worker' has incorrect type (expected "
                            f"{__name__}.GenCore, got {type(worker).__name__})")
        return self._first_switch(worker, None, pool)

    def start_generator_job(self, pool=None):
        """`start` for a generator body made by its job: `fn.generator()` gives the body's
        generator and save state, and a worker of the configured `gen_worker` class made for
        them runs it (`start_generator`)."""
        gen, state = self.fn.generator()
        return self._first_switch(_configured["gen_worker"](self, gen, state), None, pool)

    def _first_switch(self, worker, payload, pool):
        # `start`'s switch into the body's `worker` with `payload`: the body starts in the
        # model's grad mode, the model gets its mode back after, and a body that ended at
        # once is released to `pool`
        c = _configured
        self.worker = worker
        model_grad = self.body_grad = c["is_grad_enabled"]()
        try:
            message = worker.switch(payload)
        finally:
            if c["is_grad_enabled"]() != model_grad:
                c["set_grad_enabled"](model_grad)
        if message == DONE or message == FAILED:
            self.release(pool)
        return message

    def release(self, pool):
        """The body ended: it is finished, and its worker goes back to `pool` (a thread's idle
        workers) unless the worker is dead, single-use, or the pool holds POOL_MAX already."""
        worker = self.worker
        self.worker = None
        self.finished = True
        if (worker is not None and pool is not None and len(pool) < POOL_MAX
                and not worker.dead and not worker.single_use):
            pool.append(worker)


class GenCore:
    """A generator body's worker, in `mediator.worker` (`intervention.mediator.GenWorker`
    subclasses it with the policy): `switch(payload)` sends `payload` into the body's
    generator `gen`, run in its own contextvars `context` as a greenlet would run in its own,
    and returns what the body yields (PARKED). When the body returns, `switch` ends it
    (`end()`) and returns `self.returned(value)`; when it raises, `self.failed(error)`
    (GeneratorExit propagates).
    (The compiled exchange resumes one with no Python frame between the hook and the body.)
    """

    __slots__ = ("gen", "context", "token", "mediator", "home", "dead")

    def __init__(self, mediator=None, gen=None, state=None):
        """With `gen`: the body's `context` is a copy of the caller's, its save state `state`
        entered there (`enter_body`, see `configure`), `home` the calling greenlet."""
        self.mediator = mediator
        self.gen = gen
        self.dead = False
        self.token = self.context = self.home = None
        if gen is not None:
            context = self.context = copy_context()
            self.token = context.run(_configured["enter_body"], state)
            self.home = _configured["getcurrent"]()

    def end(self):
        """The body is over: `dead`, and its save state left (`exit_body`, in its context).
        `switch` does it before `returned`/`failed`."""
        self.dead = True
        token = self.token
        if token is not None:
            self.token = None
            self.context.run(_configured["exit_body"], token)

    def returned(self, values):
        """`switch`'s end when the body returned its final locals `values`: its job's
        `finish(values)` (the mediator let go first: no cycle left); DONE."""
        mediator = self.mediator
        self.mediator = None
        mediator.fn.finish(values)
        return DONE

    def switch(self, payload=None):
        try:
            return self.context.run(self.gen.send, payload)
        except StopIteration as end:
            self.end()
            return self.returned(end.value)
        except GeneratorExit:
            raise
        except BaseException as error:  # noqa: BLE001 - reported to the model side by the policy
            self.end()
            return self.failed(error)
        finally:
            payload = None


def envoy_reader(output, policy):
    """`Envoy.__interlace_read__` (intervention/envoy.py makes it once): a generator body's
    read `envoy.output` while a run of its model is on (the express run, else the general
    one: the Envoy's `_engine`) is that run's `reader(2 * _index + 1)`, when `type(envoy)`
    serves `output` with the Envoy's own property `output`; any other read is
    `policy(envoy, name)`. (Compiled: the common read with no Python frame.)"""

    def __interlace_read__(envoy, name):
        if name == "output" and type(envoy).output is output:
            fields = envoy.__dict__
            engine = fields["_engine"]
            run = engine.express or engine.general_run
            if run is not None:
                return run.reader(2 * fields["_index"] + 1)
        return policy(envoy, name)

    return __interlace_read__


def envoy_writer(output, policy):
    """`Envoy.__interlace_write__` (intervention/envoy.py makes it once): a generator body's
    `envoy.output = value` while an express run of its model is on is that run's
    `writer(2 * _index + 1, value)`, when `type(envoy)` serves `output` with the Envoy's own
    property `output`; any other assignment is `policy(envoy, name, value)`. (Compiled: the
    common edit with no Python frame.)"""

    def __interlace_write__(envoy, name, value):
        if name == "output" and type(envoy).output is output:
            fields = envoy.__dict__
            run = fields["_engine"].express
            if run is not None:
                return run.writer(2 * fields["_index"] + 1, value)
        return policy(envoy, name, value)

    return __interlace_write__


def tracer_maker(slow, cls, backend, unset):
    """`Model.trace` and `LanguageModel.trace` (models/ make each once): `model.trace(*inputs)`
    with no keyword makes the `cls` (InterleavingTracer) itself, its fields stored as its
    `__init__` stores them for that call (`args`, `backend`, `model`, the model's `engine`,
    then each name of `unset` as None); a call with any keyword (`remote=`, `trace=`, `tracer_cls=`,
    the forward's own) is `slow(model, *inputs, **keywords)`'s. (Compiled: no Python frame.)"""
    new = object.__new__

    def trace(model, *args, **kwargs):
        if kwargs:
            return slow(model, *args, **kwargs)
        tracer = new(cls)
        tracer.args = args
        tracer.kwargs = {}  # (here an unset field reads as None; compiled, as a dict made on use)
        tracer.backend = backend
        tracer.model = model  # (the instance's own fields in `__init__`'s order: one key layout)
        tracer.engine = model.__dict__["_engine"]
        for name in unset:
            setattr(tracer, name, None)
        return tracer

    return trace


def invoker_maker(slow, cls, backend, collecting, unset):
    """`InterleavingTracer.invoke` (intervention/tracer.py makes it once): `tracer.invoke(*inputs)`
    with no keyword, in the body of the tracer's own `model.trace()` (collecting invokes, no
    inputs of its own: the tracer's field named `collecting` is true), makes the `cls`
    (Invoker) itself, its fields stored as its `__init__` stores them for that call (`args`,
    `kwargs`, `backend`, `parent`, then each name of `unset` as None); every other call is
    `slow(tracer, *inputs, **keywords)`'s, which makes one with keywords or says why it may
    not. (Compiled: no Python frame.)"""
    new = object.__new__

    def invoke(tracer, *args, **kwargs):
        if kwargs or not getattr(tracer, collecting) or tracer.args or tracer.kwargs:
            return slow(tracer, *args, **kwargs)
        invoker = new(cls)
        invoker.args = args
        invoker.kwargs = {}
        invoker.backend = backend
        invoker.parent = tracer
        for name in unset:
            setattr(invoker, name, None)
        return invoker

    return invoke


def envoy_indexer(slow):
    """`Envoy.__getitem__` (intervention/envoy.py makes it once): `envoy[i]`, for an int `i`,
    is the child Envoy kept in the Envoy's `_positions` when the container's `_modules` still
    equal the copy kept there and the slot's Envoy was made before; anything else is
    `slow(envoy, key)`, which makes, checks and explains. (Compiled: the common `h[i]` with
    no Python frame.)"""

    def __getitem__(envoy, key):
        if type(key) is int:
            fields = envoy.__dict__
            positions = fields.get("_positions")
            if type(positions) is tuple and len(positions) == 3:
                children = positions[2]
                if type(children) is list and positions[0] == fields["_module"].__dict__.get("_modules"):
                    n = len(children)
                    i = key + n if key < 0 else key
                    if 0 <= i < n:
                        child = children[i]
                        if child is not None:
                            return child
        return slow(envoy, key)

    return __getitem__


def runs_here(mediator):
    """Is the calling code `mediator`'s body (its own lines or what they call)? A greenlet
    body runs on its worker; a generator body (a `GenCore` worker) runs while its generator
    does, on the greenlet that resumes it (the model's)."""
    if not isinstance(mediator, MediatorCore):
        raise TypeError(f"Argument 'mediator' has incorrect type (expected "
                        f"{__name__}.MediatorCore, got {type(mediator).__name__})")
    worker = mediator.worker
    if worker is None:
        return False
    if isinstance(worker, GenCore):
        return bool(worker.gen.gi_running) and worker.home is _configured["getcurrent"]()
    return worker is _configured["getcurrent"]()


class Event:
    """One happening of a location, as handed to bodies: its value may be replaced."""

    __slots__ = ("key", "occ", "value", "replaced")

    def __init__(self, key, occ, value):
        self.key = key
        self.occ = occ
        self.value = value
        self.replaced = False


class Exchange:
    """The model side of one event, in one call from a torch hook.

    `pre_hook(key)`/`post_hook(key)` make the callables torch calls. Each one ignores calls
    while `bypass` is non-zero or from a thread other than `thread`, counts the occurrence
    (`Hub.fire`), takes the bodies waiting for it (`Hub.take`) and, when there are none,
    returns None at once. Otherwise it makes an `Event`, hands it to each waiting body in
    invoke order (`serve`) and returns the value a body assigned, if one did.

    Policy stays in Python, as callables this calls:
      routed(key, occ, value) -> what the hook returns: the rest of the event after the
          count, for keys marked with `route(key)` (observers, pending skips); `value` is the
          output, or `(args, kwargs)` for a pre-hook. It usually calls `deliver`.
      message(mediator, message, event): a body came back with anything but PARKED; may
          raise to unwind the forward (a body failed, `tracer.stop()`).
      paused(mediator, event): while set, called after each body served has paused or ended
          (sharing variables between invokes, barriers).
    `is_grad_enabled`/`set_grad_enabled` are torch's (passed in: this module stays torch-free).

    One exchange can serve many runs: `begin(hub, thread)` starts one, `end()` forgets it
    (hooks left installed then do nothing) and drops its per-run references.
    A run object may subclass it: `hub`, `current`, `bypass`, `thread` are then its own
    attributes, read by C as struct fields. The hooks call `deliver`/`serve`/`resume`
    non-virtually: a subclass's methods of those names are not called by the hooks.
    """

    __slots__ = ("hub", "current", "bypass", "thread", "routed", "message", "paused",
                 "done", "root_call", "tapper", "pool", "routes", "row_type", "axes",
                 "backward", "is_grad_enabled", "set_grad_enabled", "getcurrent")

    def __init__(self, is_grad_enabled, set_grad_enabled, routed=None, message=None,
                 getcurrent=None):
        # A batched read's common case, taken here without calling `narrowed`: a value of
        # exactly `row_type` (the run's tensor type; None: never) in a run without
        # `backward`, whose batch axis `axes` (the run's cache, (key, shape) -> axis) holds
        # as 0 is `value[rows]`.
        self.row_type = None
        self.axes = None
        self.backward = False
        self.is_grad_enabled = is_grad_enabled
        self.set_grad_enabled = set_grad_enabled
        self.getcurrent = getcurrent
        self.done = False  # the run's model call is over: requests are refused
        self.root_call = False  # the run is one plain call of the root (its events by hand)
        self.tapper = None  # sets the Taps of requests (None: all go to the policy)
        self.pool = None  # set: a body that ends is released to it, no `message`
        self.routed = routed
        self.message = message
        self.paused = None
        self.routes = bytearray()
        self.hub = None
        self.current = None
        self.bypass = 0
        self.thread = 0

    def begin(self, hub, thread, root_call=False, pool=None):
        """A run starts: its hub, the thread its model runs in, whether it is one plain call
        of the root, and the idle-worker pool its ended bodies go back to (None: `message`
        hears of them). `done` is False until the run object says the model call is over."""
        if not isinstance(hub, Hub):
            raise TypeError(f"Exchange.begin() needs a Hub, got {type(hub).__name__}")
        self.hub = hub
        self.thread = thread
        self.root_call = bool(root_call)
        self.pool = pool
        self.done = False
        self.current = None
        self.bypass = 0
        self.paused = None
        self.routes = bytearray()

    def end(self):
        """The run is over: hooks still installed do nothing; per-run references are dropped."""
        self.hub = None
        self.current = None
        self.paused = None
        self.pool = None
        self.routes = bytearray()

    def route(self, key, on=True):
        """Send the events of `key` to `routed` (or stop sending them)."""
        n = len(self.routes)
        if key >= n:
            if not on:
                return
            self.routes.extend(bytes(key + 1 - n))
        self.routes[key] = 1 if on else 0

    def grow(self, nkeys, visits=None, positions=None):
        """Make room in the hub for keys up to `nkeys` (locations added during the run), counted
        exactly from now on; `visits`/`positions`: the learned order's, grown with them."""
        hub = self.hub
        if hub is None:
            raise RuntimeError("Exchange.grow() outside a run: call begin(hub, thread) first")
        missing = nkeys - len(hub.counts)
        if missing > 0:  # the hub indexes its tables unchecked: grow them before any fire
            hub.counts.extend([0] * missing)
            hub.exact.extend([True] * missing)
            if hub.visits is not None:
                hub.visits = visits
                hub.positions = positions

    def pre_hook(self, key):
        """The callable(module, args, kwargs) for a with-kwargs forward pre-hook at `key`."""
        return partial(self.on_hook, key, True)

    def post_hook(self, key):
        """The callable(module, args, output) for a forward hook at `key`."""
        return partial(self.on_hook, key, False)

    def hook_event(self, key, pre, args, third):
        """What the hook at `key` does, called directly (a root call's events, fired by hand):
        `pre_hook(key)(module, args, third)` without making the hook."""
        return self.on_hook(key, pre, None, args, third)

    def on_hook(self, key, pre, module, args, third):
        """One hook call; `third` is the pre-hook's kwargs or the forward hook's output."""
        hub = self.hub
        if hub is None or self.bypass or get_ident() != self.thread:
            return None
        occ = hub.fire(key)
        routes = self.routes
        if key < len(routes) and routes[key] and self.routed is not None:
            return self.routed(key, occ, (args, third) if pre else third)
        waiters = hub.take(key, occ)
        if waiters is None:
            return None
        event = Event(key, occ, (args, third) if pre else third)
        _serve(self, event, waiters)
        if event.replaced:
            return event.value
        return None

    def handoff(self, key, value):
        """Location `key` happens with `value` (fired by hand, no hook): counts it and serves
        it; returns the `Event` as the bodies left it, or None when nobody waited."""
        hub = self.hub
        if hub is None:
            raise RuntimeError("Exchange.handoff() outside a run: call begin(hub, thread) first")
        return _deliver(self, key, hub.fire(key), value)

    def deliver(self, key, occ, value):
        """Occurrence `occ` of `key` (already counted) has `value`: serves the bodies waiting
        for it; returns the `Event` as they left it, or None when nobody waited."""
        hub = self.hub
        if hub is None:
            raise RuntimeError("Exchange.deliver() outside a run: call begin(hub, thread) first")
        waiters = hub.take(key, occ)
        if waiters is None:
            return None
        event = Event(key, occ, value)
        _serve(self, event, waiters)
        return event

    def serve(self, event, waiters):
        """Hand `event` to each body in `waiters`, in invoke order (then `paused`, if set)."""
        if len(waiters) > 1:
            waiters.sort(key=_invoke_order)  # stable, like the compiled insertion sort
        for mediator in waiters:
            message = _resume(self, mediator, event, None)
            if message != 1:  # 1: PARKED
                if message == 2 and self.pool is not None:  # 2: DONE, the common end
                    mediator.release(self.pool)
                elif self.message is not None:
                    self.message(mediator, message, event)
            if self.paused is not None:
                self.paused(mediator, event)

    def wait_for(self, mediator, key, occ):
        """Body side, from `mediator`'s greenlet: park it for occurrence `occ` of `key` and
        give control back to the model side (its greenlet's parent) with PARKED, noting the
        body's grad mode. Returns None once served (the event is then `mediator.event`);
        anything else the model side hands over goes through `mediator.received(payload)`
        (which raises the signal or error it is). One call for a request's whole wait."""
        if mediator is None:
            raise TypeError("Exchange.wait_for() needs a mediator, got None")
        hub = self.hub
        if hub is None:
            raise RuntimeError("Exchange.wait_for() outside a run: call begin(hub, thread) first")
        hub.park(key, occ, mediator)
        mediator.event = None
        mediator.body_grad = self.is_grad_enabled()
        return _wait(mediator)

    def request(self, key, mediator=None):
        """Body side: wait for location `key` at the occurrence `mediator`'s pointer names
        (default: the running body's); returns the `Event` it is served.

        Mechanism for the common case; the policy is the run object's own methods, called
        only when needed: `mediator(key)` (no mediator given: the running body's, or the
        error that says why there is none), `refuse(key, occ, passed, event)` (raises: the
        run is over, or that occurrence has passed) and `install_by_policy(key)` (when the
        `tapper` cannot set the Taps itself)."""
        if mediator is None:
            mediator = self.mediator(key)
        elif not isinstance(mediator, MediatorCore):
            raise TypeError(f"Exchange.request() needs a MediatorCore, got {type(mediator).__name__}")
        return _request(self, mediator, key)

    def prepare(self, mediator, key):
        """Body side, for a generator body (which waits by yielding, not by switching):
        `request`'s work up to the wait. Returns the `Event` when the body is being served
        that occurrence already; else parks `mediator` for it, notes the body's grad mode and
        returns None (the body then yields PARKED; once resumed, `mediator.event` is it)."""
        if mediator is None:
            raise TypeError("Exchange.prepare() needs a mediator, got None")
        if not isinstance(mediator, MediatorCore):
            raise TypeError(f"Argument 'mediator' has incorrect type (expected "
                            f"{__name__}.MediatorCore, got {type(mediator).__name__})")
        return _prepare(self, mediator, key)

    def read(self, key):
        """Body side: the value of location `key` at the bound occurrence, as the running
        body sees it (its rows of a batch: the run object's `narrowed(event, mediator, key)`)."""
        mediator = self.current
        if mediator is None or self.getcurrent is None or mediator.worker is not self.getcurrent():
            mediator = self.mediator(key)  # raises: not the running body
        event = _request(self, mediator, key)
        if mediator.rows is None:
            return event.value
        return _narrowed(self, event, mediator, key)

    def start_all(self, mediators):
        """Model side: run each body of `mediators`, in order, until its first request or its
        end (`mediator.start(pool)`, as `current`). A start that came back with anything but
        PARKED or DONE, or any start while the run has `participants`, goes to the run
        object's `_started(mediator, message)` (policy); the loop ends once the run is
        `stopped` or has a `failure` (the run object's fields)."""
        pool = self.pool
        for mediator in mediators:
            self.current = mediator
            try:
                message = mediator.start(pool)
            finally:
                self.current = None
            if message != PARKED and message != DONE or self.participants:
                self._started(mediator, message)
            if self.stopped or self.failure is not None:
                return

    def reader(self, key):
        """Body side, for a generator body: what its `yield from` runs to read location
        `key` (`GenRead`) when the running body is a generator body on the model's greenlet
        (the common case); else the run object's `generator_read(key)`, which serves or
        refuses every other case."""
        mediator = self.current
        if mediator is not None and self.getcurrent is not None:
            worker = mediator.worker
            if isinstance(worker, GenCore) and worker.gen.gi_running and worker.home is self.getcurrent():
                return GenRead(self, mediator, key)
        return self.generator_read(key)

    def resume(self, mediator, event, payload=None):
        """Switch to `mediator`'s body with `payload` until it pauses; returns its message.

        While it runs, `current` is the mediator and its `event` is `event`; torch's grad mode
        is the body's, and the model's again afterwards, whatever the body did.
        """
        if mediator is None:
            raise TypeError("Exchange.resume() needs a mediator, got None")
        if not isinstance(mediator, MediatorCore):
            raise TypeError(f"Argument 'mediator' has incorrect type (expected "
                            f"{__name__}.MediatorCore, got {type(mediator).__name__})")
        model_grad = self.is_grad_enabled()  # (grad modes are bools: no bool() as in C)
        body_grad = mediator.body_grad
        self.current = mediator
        mediator.event = event
        try:
            if body_grad is not None and body_grad != model_grad:
                self.set_grad_enabled(body_grad)
            return mediator.worker.switch(payload)
        finally:
            # Back on the model side: its grad mode again, whatever the body did.
            if self.is_grad_enabled() != model_grad:
                self.set_grad_enabled(model_grad)
            mediator.event = None
            self.current = None


# The hooks' own calls are non-virtual, as the compiled ones are (cdef).
_deliver, _serve, _resume = Exchange.deliver, Exchange.serve, Exchange.resume


def _request(self, mediator, key):
    """`Exchange.request`'s work, non-virtual (the compiled `c_request`)."""
    event = _prepare(self, mediator, key)
    if event is not None:
        return event
    _wait(mediator)  # switch to the model side, wait to be served
    return mediator.event


def _prepare(self, mediator, key):
    """`Exchange.prepare`'s work (the compiled `c_prepare`): the served event, or None parked."""
    hub = self.hub
    if hub is None:
        raise RuntimeError("Exchange.request() outside a run: call begin(hub, thread) first")
    event = mediator.event
    passed = hub.so_far(key)
    if event is not None and event.key == key:
        occ = mediator.pointer.bind(event.occ)
        if event.occ == occ:
            return event
    else:
        occ = mediator.pointer.bind(passed)
    if self.done or occ < passed:
        self.refuse(key, occ, passed, event)  # raises
    if self.tapper is None or not self.tapper.install(self, key, self.root_call):
        self.install_by_policy(key)
    hub.park(key, occ, mediator)
    mediator.event = None
    mediator.body_grad = self.is_grad_enabled()
    return None


def _wait(mediator):
    """The parked body's switch to the model side (counted), until it is served (the compiled
    `c_wait`)."""
    mediator.parks += 1
    payload = mediator.worker.parent.switch(PARKED)
    if payload is None:
        return None
    try:
        return mediator.received(payload)
    finally:
        payload = None  # an error raised here has this frame in its traceback: no cycle


class GenRead:
    """One read of location `key` by a generator body, as the iterator its `yield from` runs
    (`Exchange.reader`): the request up to the park (`Exchange.prepare`), PARKED yielded
    while the value is not there, then the value, narrowed to the body's rows by the run
    object's `narrowed(event, mediator, key)`, returned (StopIteration). What the model side
    sends instead of None goes through `mediator.received(payload)` (which raises it)."""

    __slots__ = ("exchange", "mediator", "key", "parked")

    def __init__(self, exchange, mediator, key):
        self.exchange = exchange
        self.mediator = mediator
        self.key = key
        self.parked = False

    def __iter__(self):
        return self

    def __next__(self):
        return self.send(None)

    def send(self, payload):
        mediator = self.mediator
        if mediator is None:
            raise StopIteration  # (already returned)
        if self.parked:
            if payload is not None:
                mediator.received(payload)  # raises the signal or error it is
            event = mediator.event
        else:
            event = _prepare(self.exchange, mediator, self.key)
            if event is None:
                self.parked = True
                return PARKED
        exchange, self.exchange, self.mediator = self.exchange, None, None
        if mediator.rows is None:
            raise StopIteration(event.value)
        raise StopIteration(_narrowed(exchange, event, mediator, self.key))


def _narrowed(exchange, event, mediator, key):
    """`mediator`'s rows of `event`'s value: the common case (see `Exchange.row_type`) here,
    else the run object's `narrowed(event, mediator, key)`, the policy."""
    value = event.value
    if (exchange.row_type is not None and type(value) is exchange.row_type
            and not exchange.backward and type(exchange.axes) is dict):
        axis = exchange.axes.get((key, value.shape))
        if axis is not None and axis == 0:
            return value[mediator.rows]
    return exchange.narrowed(event, mediator, key)


class Hook:
    """A torch hook of one location: all of its work happens in `Exchange.on_hook`."""

    __slots__ = ("exchange", "key", "pre")

    def __init__(self, exchange, key, pre):
        self.exchange = exchange
        self.key = key
        self.pre = pre

    def call(self, module, args, third):
        """The hook, as a bound method (the compiled exchange hands these out)."""
        return self.exchange.on_hook(self.key, self.pre, module, args, third)

    def __call__(self, module, args, third):
        return self.exchange.on_hook(self.key, self.pre, module, args, third)


UNSET = object()
"""`Taps.tapped`'s "the module had no instance `forward`" (removing its Tap deletes the slot)."""

_OWN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class Taps:
    """The Taps one run sets on its model's modules: the common case of `hooks.install`
    (and of `hooks.remove`) in one call.

    Python decides which modules may have a Tap (`know`: a class whose calls run the
    instance's `forward`); this only repeats the per-trace checks (no torch hooks of the
    module's own or global ones, its instance `forward` as it was when the model was
    wrapped) and sets the Taps. `install` returns False, having changed nothing, whenever
    a module on the way needs Python's policy. `handles`, `taps` and `tapped` are the run's
    containers (key -> None for a key a Tap fires; index -> Tap; index -> (instance dict,
    instance forward before, or UNSET)). It holds no run: the run is an argument.
    """

    __slots__ = ("handles", "taps", "tapped", "modules", "dicts", "forwards", "classes",
                 "ancestors", "global_hooks", "result_key", "enabled")

    def __init__(self, state, global_hooks, enabled):
        if type(global_hooks) is not tuple:
            raise TypeError("Taps() needs the global hook dicts as a tuple")
        self.handles = {}
        self.taps = {}
        self.tapped = {}
        self.modules = list(state.modules)
        self.dicts = [module.__dict__ for module in self.modules]
        self.forwards = list(state.forwards)
        self.classes = [None] * len(self.modules)
        self.ancestors = tuple(state.ancestors)
        self.global_hooks = global_hooks
        self.result_key = state.result_key
        self.enabled = bool(enabled)

    def know(self, index, cls):
        """Module `index` of class `cls` can have a Tap (Python checked the class once)."""
        self.classes[index] = cls

    def _plain(self, index):
        # Can module `index` get (or already has) a Tap with no policy to apply?
        if index in self.taps:
            return True
        if type(self.modules[index]) is not self.classes[index]:
            return False
        instance = self.dicts[index]
        if instance.get("forward") is not self.forwards[index]:
            return False
        for name in _OWN_HOOKS:
            if instance.get(name):
                return False
        return True

    def install(self, run, key, root_call):
        """Hook location `key` for `run` as `hooks.install` would, when every module on the way
        is plain (see the class); True when done or nothing was needed, False when Python must."""
        if run is None:
            raise TypeError("Taps.install() needs an Exchange, not None")
        handles = self.handles
        if key in handles or key >= self.result_key or (key < 2 and root_call):
            return True
        if not self.enabled:
            return False
        for hooks in self.global_hooks:
            if hooks:
                return False
        index = key >> 1
        chain = self.ancestors[index]
        for ancestor in chain:
            if 2 * ancestor not in handles and not (ancestor == 0 and root_call):
                if not self._plain(ancestor):
                    return False
        if not self._plain(index):
            return False
        for ancestor in chain:
            if 2 * ancestor not in handles and not (ancestor == 0 and root_call):
                self.tap(run, 2 * ancestor, ancestor)
        self.tap(run, key, index)
        return True

    def tap(self, run, key, index):
        """Fire `key`'s events from module `index`'s Tap, set on it now unless this run has
        one there already (Python checked that the module may have one)."""
        run.hub.observe(key)
        tap = self.taps.get(index)
        if tap is None:
            instance = self.dicts[index]
            current = instance.get("forward")
            tap = Tap(run, getattr(self.modules[index], "forward") if current is None else current)
            self.taps[index] = tap
            self.tapped[index] = (instance, UNSET if current is None else current)
            instance["forward"] = tap
        if key & 1:
            tap.post = key
        else:
            tap.pre = key
        self.handles[key] = None

    def remove(self):
        """Take every Tap off (one the user replaced since stays replaced) and forget the
        handles; returns the hook tokens among them (not None) for Python to detach, or None."""
        tokens = None
        for token in self.handles.values():
            if token is not None:
                if tokens is None:
                    tokens = []
                tokens.append(token)
        self.handles.clear()
        if self.taps:
            for index, (instance, previous) in self.tapped.items():
                tap = self.taps[index]
                tap.pre = tap.post = -1  # a reference kept somewhere fires nothing more
                if instance.get("forward") is tap:
                    if previous is UNSET:
                        del instance["forward"]
                    else:
                        instance["forward"] = previous
            self.taps.clear()
            self.tapped.clear()
        return tokens


class _Forwarding:
    """What a module's `forward` wrapper (`Tap`, `ExpressTap`) shows of the forward it wraps,
    `original`: `__wrapped__` (`inspect.signature` and `functools` look through it) and every
    other attribute (`module.forward.__func__`, `.__self__`, `.__name__`...)."""

    __slots__ = ("original",)

    @property
    def __wrapped__(self):
        """The forward it wraps."""
        return self.original

    def __getattr__(self, name):
        if name == "original" or name in type(self).__slots__:  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.original, name)


class Tap(_Forwarding):
    """A module's `forward` for one run: its input and output events, without torch hooks.

    torch runs a module's hooks only on its slow call path, which costs about what a small
    module's own work costs (~30k instructions a call, measured); a module with no hooks is
    called on the fast path, which calls `module.forward`: this, installed on the instance.
    It fires the input event (key `pre`; -1: none) before calling `original`, and the output
    event (`post`) after, through `Exchange.on_hook`, as the hooks would, with the same
    replacements. Keys are read at each call: one set while the module runs (a body asking
    for a container's output from inside it) is served when that call returns.
    """

    __slots__ = ("exchange", "pre", "post")

    def __init__(self, exchange, original):
        if exchange is None:
            raise TypeError("Tap() needs an Exchange, not None")
        self.exchange = exchange
        self.original = original
        self.pre = -1
        self.post = -1

    def __call__(self, *args, **kwargs):
        key = self.pre
        positional = args
        keywords = kwargs
        if key >= 0:
            replaced = self.exchange.on_hook(key, True, None, args, kwargs)
            if replaced is not None:
                positional, keywords = replaced
        output = self.original(*positional, **keywords)
        key = self.post
        if key >= 0:
            replaced = self.exchange.on_hook(key, False, None, positional, output)
            if replaced is not None:
                return replaced
        return output


# Where an express run is (`ExpressCore.stage`), in order.
BODY_START = 0
FORWARD = 1
RETURNED = 2
ROOT_FIRED = 3
RESULT_FIRED = 4


class ExpressCore:
    """An express run's fields, the run itself (`run`: the body started, the root called,
    the run ended) and the steps its wrappers and reads take per module: `ahead` (can the
    run serve this key, wrappers set for it), `serve` (send a module's output into the
    body), `switch` (resume the body), `unwrap`. `run` leaves to the policy a body that fails
    or is handed over before the forward (`_raise`, `_general_from_start`), a root that
    returns while the body waits (`_after_return`) and a body's ends (`_ended`; the compiled
    run takes the common one itself). `intervention.express.Express` subclasses it with
    the policy: `_wrap(index)` decides whether module `index` (and the modules containing it)
    may have a wrapper and records the decision as a *plan* (`plans[index]`: a tuple of
    `(index, module, instance dict, ExpressTap, class, class's forward,
    PlanCheck)`); later runs repeat
    only the plan's checks (no hooks of the module's own or global ones, no instance
    `forward`, the class and its `forward` as planned) and set its wrappers; any check that
    fails asks `_wrap` again. `_ended(values, error)` maps the body's end, `_failed(key)`
    raises for a body that failed while served, and `_served_over(key, value, message)`
    finishes a `serve` inside which the run was handed over; `generator_read(key)` is its
    read (the compiled one serves the common reads itself, `_ExpressRead`; `_read_over(key)`
    and `handover` are for those).
    (The compiled one takes these steps with no Python frame.)
    """

    __slots__ = ("want", "stage", "position", "result_key", "positions", "interleaver", "gen",
                 "context", "body_grad", "wrapped", "plans", "served", "serving", "value",
                 "replaced", "global_hooks", "handover",
                 # the run's own (see the compiled class)
                 "engine", "state", "body", "out", "token", "dead", "worker", "error", "event",
                 "last_write", "cut")

    def __init__(self, global_hooks, handover=None):
        if global_hooks is None:
            raise TypeError("ExpressCore() needs a tuple of hook dicts, not None")
        self.want = -1
        self.stage = 0
        self.position = -1
        self.result_key = 0
        self.positions = self.interleaver = self.gen = self.context = self.body_grad = None
        self.wrapped = {}
        self.plans = {}
        self.served = []
        self.serving = -1
        self.value = None
        self.replaced = False
        self.global_hooks = global_hooks
        self.handover = handover
        self.engine = self.state = self.body = self.out = self.token = self.worker = None
        self.error = self.event = self.last_write = None
        self.dead = self.cut = False

    def reader(self, key):
        """Body side: what a generator body's `yield from` runs to read module output `key`
        (the Envoy's `.output`): `generator_read(key)`."""
        return self.generator_read(key)

    def writer(self, key, value):
        """Body side: what a generator body's `yield from` runs to set module output `key`
        to `value` (the Envoy's `.output = value`): `generator_write(key, value)`."""
        return self.generator_write(key, value)

    def ahead(self, key):
        """Can this run serve `key` (and are the wrappers for it set)?"""
        result_key = self.result_key
        if key == result_key:
            return self.stage < RESULT_FIRED
        if key & 1 == 0 or key > result_key:
            return False  # an input (the general run serves them), an added location
        if key == 1:
            return self.stage < ROOT_FIRED
        places = self.positions[key]
        if not places or places[0] <= self.position:
            return False  # it never runs, or its first occurrence has passed
        plan = self.plans.get(key >> 1)
        if plan is not None:
            done = self._set_plan(plan)
            if done >= 0:
                return bool(done)
        return self._wrap(key >> 1)

    def _set_plan(self, plan):
        # the plan's wrappers set (1); 0 when global hooks stop it; -1 when Python must decide
        wrapped = self.wrapped
        if any(self.global_hooks):
            return 0
        for index, module, instance, wrapper, cls, forward, _ in plan:
            if index in wrapped:
                continue
            if "forward" in instance or type(module) is not cls:
                return -1
            for name in _OWN_HOOKS:
                if instance.get(name):
                    return -1
            if cls.forward is not forward:
                return -1
        for index, module, instance, wrapper, cls, forward, check in plan:
            if index not in wrapped:
                instance["forward"] = wrapper
                wrapped[index] = (instance, wrapper, check)
        return 1

    def run(self, engine, body, out, args, kwargs):
        """Run the root on `args`/`kwargs` with `body` (a deferred body on the generator
        route) beside it, its final locals into `out`; the caller took `engine`'s lock for
        this thread, which this releases. The common run, start to end; the policy's
        methods take every other case (`_general_from_start`, `_raise`, `_stopped`,
        `_model_failed` (after a write or a hand-over), `_after_return`, `_close_general`:
        after a hand-over, the general run's). (Compiled: no Python frame.)"""
        self.engine = engine
        self.body = body
        self.out = out
        self.cut = self.dead = False
        eager = _eager_run()
        try:
            state = self.state
            # the body's contextvars are its own, and `.save()` saves into its save state
            self.token = self.begin(state.positions, state.result_key, body.generator(), body.state)
            engine.express = self
            message = self.switch(None)  # the body, up to its first read
            if self.interleaver is not None:
                return self._general_from_start(message, args, kwargs)
            if type(message) is int:
                if message == FAILED:
                    return self._raise()
                if message < 0:
                    self.want = ~message
            self.stage = FORWARD
            try:
                result = state.root(*args, **kwargs)
            except _configured["stops"]:  # a body failed in a wrapper (or stopped, handed over)
                return self._stopped()
            except Exception as error:
                if self.interleaver is not None or self.last_write is not None:
                    self._model_failed(error)  # (the policy names the body's last write)
                raise
            self.stage = RETURNED
            if self.interleaver is None and self.want == -1:
                return result  # (the common end: the body ended inside the forward)
            return self._after_return(args, result)
        finally:
            self._close(eager)

    def _close(self, eager):
        """Take off what the run set, end a body that would not end, let the model go."""
        engine = self.engine
        interleaver = self.interleaver
        engine.express = None  # (a body's `finally` run below reads no express state)
        try:
            if interleaver is not None:
                self._close_general(interleaver)
            else:
                self.unwrap()
                if self.gen is not None and not self.dead:  # (the model raised while it waited)
                    self.dead = True
                    _configured["close_body"](self.gen, self.context, self.token)
        finally:
            self.end()
            self.body = self.out = self.token = self.worker = self.error = self.event = None
            self.last_write = self.engine = None
            engine.general_run = None
            engine.owner = None
            engine.lock.release()
            if eager is not None:
                _configured["restore"](eager)
            if interleaver is not None and interleaver.reusable and len(engine.idle) < 2:
                engine.idle.append(interleaver)

    def begin(self, positions, result_key, gen, state):
        """A run's start: its fields as new, the model's learned `positions` (plans made
        for other ones forgotten), the body's generator `gen` to run in a copy of the
        caller's contextvars context with its save state `state` entered there
        (`enter_body`, see `configure`); returns that token."""
        if positions is not self.positions:  # learned again: which modules run may differ
            self.plans.clear()
            self.positions = positions
        self.result_key = result_key
        self.stage = 0
        self.position = -1
        self.replaced = False
        self.gen = gen
        context = self.context = copy_context()
        token = context.run(_configured["enter_body"], state)
        self.body_grad = _configured["is_grad_enabled"]()
        return token

    def end(self):
        """A run's end: the fields let go of the body, its values and the general run."""
        self.gen = self.context = self.value = self.interleaver = None
        self.served.clear()
        self.want = self.serving = -1

    def unwrap(self):
        """Take off every wrapper this run set (one the user replaced since stays)."""
        for instance, wrapper, _ in self.wrapped.values():
            if instance.get("forward") is wrapper:
                del instance["forward"]
        self.wrapped.clear()

    def serve(self, key, value):
        """Send `value` (occurrence 0 of `key`) into the waiting body; returns the value as
        the body left it (a write replaces it). A body that failed: `_failed(key)`."""
        self.want = -1
        if key != 1 and key != self.result_key:
            self.served.append(key)
            self.position = self.positions[key][0]
        self.serving = key
        self.value = value
        self.replaced = False
        message = self.switch(None)  # (the waiting read returns `value`, as it is then)
        if self.interleaver is not None:  # handed over while it ran: its policy finishes
            return self._served_over(key, value, message)
        self.serving = -1
        if self.replaced:
            value = self.value
        self.value = None
        if type(message) is int and message < 0:
            self.want = ~message
        elif message == FAILED:
            self._failed(key)
        return value

    def switch(self, payload):
        """Resume the body with `payload` until it reads (yields `~key`) or ends (then
        `_ended(values, error)`'s message), in its own grad mode and contextvars context.
        GeneratorExit propagates."""
        is_grad_enabled, set_grad_enabled = _configured["is_grad_enabled"], _configured["set_grad_enabled"]
        model_grad = is_grad_enabled()
        if self.body_grad != model_grad:
            set_grad_enabled(self.body_grad)
        try:
            return self.context.run(self.gen.send, payload)
        except StopIteration as end:
            return self._ended(end.value, None)
        except GeneratorExit:
            raise
        except BaseException as error:  # noqa: BLE001 - reported to the model side by the policy
            return self._ended(None, error)
        finally:
            payload = None
            grad = is_grad_enabled()
            self.body_grad = grad
            if grad != model_grad:
                set_grad_enabled(model_grad)


class PlanCheck:
    """What the checks of one entry of an express run's plan last found. The compiled run
    keeps there what lets it cut the checks short (the instance dict's and the class's
    versions); here every check is made in full, and it keeps nothing."""

    __slots__ = ()


class ExpressTap(_Forwarding):
    """Module `key >> 1`'s `forward` for its model's express runs (made once, set per run):
    calls the forward it wraps, then sends the output into the body when the run waits for
    it (`run.serve(key, output)`); after a hand-over the output is the general run's event.
    Holds its run weakly (the run keeps its wrappers); outside a run it is the forward."""

    __slots__ = ("ref", "key")

    def __init__(self, ref, key, original):
        self.ref = ref
        self.key = key
        self.original = original

    def __call__(self, *args, **kwargs):
        output = self.original(*args, **kwargs)
        run = self.ref()
        if run is None:
            return output
        if run.want == self.key:
            return run.serve(self.key, output)
        interleaver = run.interleaver
        if interleaver is not None:  # handed over: this call's output is its event now
            replaced = interleaver.hook_event(self.key, False, args, output)
            if replaced is not None:
                return replaced
        return output


def call_below(depth, fn):
    """Return fn(): the compiled twin reserves `depth` bytes of C stack below the caller
    first (a greenlet started there runs below a forward that resumes it; mediator.py)."""
    return fn()
