# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled hot path of the interleaving engine; twin: src/interlace/_pyhotpath.py.

Mechanism only: occurrence counters, the position in a model's learned order, the table of
parked requests, a mediator's iteration pointer, and the model side of one event (count it,
find the waiting bodies, hand the value to each on its greenlet with its grad mode). Every
decision is made in Python (interlace/intervention/), through callables given to `Exchange`.
Keep this file and the twin equivalent: the suite runs on both (INTERLACE_NO_EXTENSIONS=1
selects the twin). Torch-free and greenlet-free at build time: torch's grad-mode functions
are handed in, and a greenlet is switched through its `switch` method.

Ownership: everything here is Cython-managed Python objects. Arguments are borrowed; every
method returns a new reference (an int, a list, an Event, or None); containers stored in a
Hub own strong references to their items (parked waiters are kept alive until
`take`/`drain`); an Exchange owns strong references to its hub, policy callables and current
mediator until `end()`.
"""

cimport cython
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE

RELAXED = -1
POOL_MAX = 64  # idle workers kept per thread (see MediatorCore.release)

cdef class Taps  # defined below; an Exchange keeps its run's
cdef class ExpressCore  # defined below; an Envoy's read and write call its `c_reader`, `c_writer`


@cython.final
cdef class Hub:
    """Occurrence counters, the position in the learned order, and the parked requests."""

    cdef public list counts
    cdef public list exact
    cdef public dict parked
    cdef public Py_ssize_t nparked
    cdef public Py_ssize_t calls
    cdef public Py_ssize_t position
    cdef public Py_ssize_t root
    cdef public object visits      # tuple[int] or None
    cdef public object positions   # tuple[tuple[int]] or None
    cdef public object record      # list or None

    def __init__(self, Py_ssize_t nkeys, Py_ssize_t root, visits, positions, learning):
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

    cpdef Py_ssize_t fire(self, Py_ssize_t key):
        """A hooked location happened: count it and move the position. Returns its occurrence."""
        cdef Py_ssize_t occ = self.counts[key]
        cdef Py_ssize_t v, j
        self.counts[key] = occ + 1
        if key == self.root:
            self.calls += 1
        if self.record is not None:
            self.record.append(key)
        if self.visits is not None:
            v = (<tuple>self.visits)[key]
            if v:
                j = occ - (self.calls - 1) * v
                if 0 <= j < v:
                    self.position = (<tuple>(<tuple>self.positions)[key])[j]
        return occ

    cpdef Py_ssize_t so_far(self, Py_ssize_t key):
        """How many times `key` has happened so far in this trace (observed or derived)."""
        cdef Py_ssize_t v, n, p
        if self.exact[key]:
            return self.counts[key]
        if self.visits is None or self.calls == 0:
            return 0
        v = (<tuple>self.visits)[key]
        n = (self.calls - 1) * v
        for p in (<tuple>self.positions)[key]:
            if p <= self.position:
                n += 1
        return n

    cpdef observe(self, Py_ssize_t key):
        """`key` is hooked from now on: its counter continues from the derived count."""
        if not self.exact[key]:
            self.counts[key] = self.so_far(key)
            self.exact[key] = True

    cpdef park(self, Py_ssize_t key, Py_ssize_t occ, waiter):
        """Wait for occurrence `occ` of `key`; waiters of one event are served in park order."""
        cdef dict by_occ = self.parked.get(key)
        cdef list waiters
        if by_occ is None:
            by_occ = {}
            self.parked[key] = by_occ
        waiters = by_occ.get(occ)
        if waiters is None:
            by_occ[occ] = [waiter]
        else:
            waiters.append(waiter)
        self.nparked += 1

    cpdef take(self, Py_ssize_t key, Py_ssize_t occ):
        """The waiters of (key, occ), removed from the table; None when nobody waits (fast)."""
        cdef dict by_occ
        cdef list waiters
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

    cpdef list drain(self):
        """Every parked (key, occ, waiter), removed from the table (the run has ended)."""
        cdef list out = []
        for key, by_occ in self.parked.items():
            for occ, waiters in by_occ.items():
                for waiter in waiters:
                    out.append((key, occ, waiter))
        self.parked = {}
        self.nparked = 0
        return out


@cython.final
cdef class Pointer:
    """A mediator's iteration pointer: which occurrence its next request binds to.

    `iteration` >= 0 binds every request to that occurrence (the default is 0: one forward
    pass); `RELAXED` binds each request to the next occurrence of its location not yet
    passed. `pin(n)` makes only the next request bind to `n`, after which the pointer is
    relaxed. `depth` counts enclosing `tracer.iter` loops. `save()`/`restore()` let loops nest.
    """

    cdef public Py_ssize_t iteration
    cdef public Py_ssize_t pinned
    cdef public Py_ssize_t depth

    def __init__(self):
        self.iteration = 0
        self.pinned = RELAXED
        self.depth = 0

    cpdef Py_ssize_t bind(self, Py_ssize_t upcoming):
        """The occurrence a request binds to; `upcoming` is the next one not yet passed."""
        cdef Py_ssize_t occ = self.pinned
        if occ >= 0:
            self.pinned = RELAXED
            self.iteration = RELAXED
            return occ
        occ = self.iteration
        if occ >= 0:
            return occ
        return upcoming

    cpdef pin(self, Py_ssize_t n):
        if n < 0:
            raise ValueError(f"iteration must be >= 0, got {n}")
        self.pinned = n

    cpdef tuple save(self):
        return (self.iteration, self.pinned, self.depth)

    cpdef restore(self, tuple state):
        self.iteration, self.pinned, self.depth = state


# -- the per-event exchange -------------------------------------------------------------------

# Messages a mediator's greenlet sends back to the side that resumed it.
PARKED = 1   # the body waits for a value (it is in the hub's table)
DONE = 2     # the body returned
FAILED = 3   # the body raised
STOPPED = 4  # the body called tracer.stop()

cdef extern from "pythread.h":
    unsigned long PyThread_get_thread_ident()

cdef extern from "_chotpath_impl.h":
    const int ILH_UNWIND_STOP
    object ilh_outermost(object fn)

UNWIND_STOP = bool(ILH_UNWIND_STOP)
"""True where `outermost`'s native frame ends every unwind (x86-64 and aarch64 Linux)."""


def outermost(fn):
    """Return fn(), called from a native frame whose unwind information marks it outermost.

    A worker greenlet's run: the C stack above a greenlet's first frame is not its own once
    it is resumed from elsewhere, and an unwinder that walks into it (torch records a native
    backtrace for every error it raises) can crash. Where UNWIND_STOP is False this is a
    plain call.
    """
    return ilh_outermost(fn)


# What a mediator's start needs from greenlet and torch, and the policy for a new worker:
# given once by intervention.mediator (`configure`); this module stays free of both.
cdef object _getcurrent = None
cdef object _is_grad_enabled = None
cdef object _set_grad_enabled = None
cdef object _new_worker = None
cdef object _idle_workers = None
cdef object _enter_body = None
cdef object _exit_body = None
cdef object _gen_worker = None


def configure(getcurrent, is_grad_enabled, set_grad_enabled, new_worker, idle_workers,
              enter_body=None, exit_body=None, gen_worker=None):
    """Set what `MediatorCore.start` calls: greenlet's `getcurrent`, torch's grad-mode getter
    and setter, `new_worker()` (a worker greenlet, when the pool is empty: policy) and
    `idle_workers()` (this thread's pool, when `start` is given none); and what a `GenCore`
    calls to enter a body's save state and leave it: `enter_body(state) -> token`,
    `exit_body(token)`; `gen_worker(mediator, gen, state)`, the `GenCore` subclass that
    `start_generator_job` makes."""
    global _getcurrent, _is_grad_enabled, _set_grad_enabled, _new_worker, _idle_workers
    global _enter_body, _exit_body, _gen_worker
    _getcurrent = getcurrent
    _is_grad_enabled = is_grad_enabled
    _set_grad_enabled = set_grad_enabled
    _new_worker = new_worker
    _idle_workers = idle_workers
    _enter_body = enter_body
    _exit_body = exit_body
    _gen_worker = gen_worker


cdef object _force_eager = None
cdef object _restore_eager = None
cdef object _quiet_backends = None
cdef dict _quiet = None  # the dict `quiet_backends()` gave when `force_eager` had nothing to do,
cdef Py_ssize_t _quiet_size = -1  # and its size then
cdef object _close_body = None
cdef object _stops = ()
cdef tuple _hidden = ()


def configure_express(force_eager, restore, quiet_backends, close_body, stops, hidden):
    """Set what `ExpressCore.run` calls: `force_eager() -> token` and `restore(token)` (a
    compiled model runs eagerly during a run; `quiet_backends()`, after `force_eager` gave
    None, the dict whose unchanged size means it would give None again, or None: the run
    calls `force_eager` only when that size changed), `close_body(gen, context, token)` (a body
    that did not end); `stops`, the exceptions by which a failed or stopped body ends the
    forward from a wrapper; `hidden`, the names of a generator body's hidden parameters,
    dropped from its final locals (as `DeferredBody.generator_locals` drops them)."""
    global _force_eager, _restore_eager, _quiet_backends, _quiet, _quiet_size, _close_body
    global _stops, _hidden
    _force_eager = force_eager
    _restore_eager = restore
    _quiet_backends = quiet_backends
    _quiet = None
    _quiet_size = -1
    _close_body = close_body
    _stops = tuple(stops)
    _hidden = tuple(hidden)


cdef object _plain_job = None        # see `plain_job`
cdef object _plain_generator = None
cdef object _plain_finish = None
cdef tuple _plain_hidden = ()


def plain_job(cls, hidden):
    """Take in C the steps of a `cls` job (intervention.body.BodyJob) that are mechanism, while
    the class's `generator` and `finish` are the ones it has now (a subclass, or a method
    replaced since, is called as usual): its `generator()` is `(job.body.generator(),
    job.body.state)` and its `finish(values)` is `job.out.update(values)` less the `hidden`
    names (as `DeferredBody.generator_locals` drops them). No Python frame per body for
    either."""
    global _plain_job, _plain_generator, _plain_finish, _plain_hidden
    _plain_job = cls
    _plain_generator = cls.generator
    _plain_finish = cls.finish
    _plain_hidden = tuple(hidden)


cdef object _eager_run():
    # `force_eager()`, unless the dict it last had nothing to do for has kept its size
    global _quiet, _quiet_size
    if _quiet is not None and len(_quiet) == _quiet_size:
        return None
    eager = _force_eager()
    _quiet = None
    if eager is None:
        quiet = _quiet_backends()
        if type(quiet) is dict:
            _quiet_size = len(<dict>quiet)
            _quiet = <dict>quiet
    return eager


cdef class MediatorCore:
    """A mediator's fields, read and written by the exchange as struct fields, not by name,
    and the start of its body (mechanism: a pooled worker, grad modes, one switch).

    `intervention.mediator.Mediator` subclasses it. A subclass must not list these names in
    its own `__slots__`: a slot of the same name would hide the field, and the exchange would
    go on reading the field while Python code writes the slot.
    """

    cdef public Py_ssize_t index   # invoke order: waiters of one event are served by it
    cdef public object rows        # the batch rows this body sees, or None
    cdef public object pointer     # its iteration Pointer
    cdef public object worker      # the greenlet running the body, or None
    cdef public object event       # the Event being served to it right now, or None
    cdef public object body_grad   # torch grad mode the body had when it last paused
    cdef public bint finished
    cdef public object fn          # the body: called with no argument by the subclass's `_job`
    cdef public object error       # what the body raised (FAILED), until the run takes it
    cdef public object label       # "trace body", "invoke 1"...: for messages
    cdef public Py_ssize_t parks   # waits through `wait_for` (a greenlet body's), counted

    def __init__(self, fn=None, Py_ssize_t index=0, rows=None, label="trace body"):
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
        self.parks = 0

    def start(self, list pool=None):
        """Run the body (the subclass's `_job`) on a worker from `pool` (default: this
        thread's idle workers) until its first request or its end; returns its message.
        The body starts in the model's grad mode, and the model gets its mode back after."""
        if pool is None:
            pool = _idle_workers()
        if pool:
            worker = pool.pop()
        else:
            worker = _new_worker()
        worker.parent = _getcurrent()
        return first_switch(self, worker, self._job, pool)

    def start_generator(self, GenCore worker not None, list pool=None):
        """`start` for a generator body: `worker` (made for it) runs the body until its first
        request (or its end); returns its message. Grad modes as `start`'s; an ended body is
        released to `pool`."""
        return first_switch(self, worker, None, pool)

    def start_generator_job(self, list pool=None):
        """`start` for a generator body made by its job: `fn.generator()` gives the body's
        generator and save state (a plain job's, `plain_job`, taken here), and a worker of
        the configured `gen_worker` class made for them runs it (`start_generator`)."""
        fn = self.fn
        if type(fn) is _plain_job and _plain_job.generator is _plain_generator:
            body = fn.body
            gen = body.generator()
            state = body.state
        else:
            gen, state = fn.generator()
        return first_switch(self, _gen_worker(self, gen, state), None, pool)

    def release(self, list pool):
        """The body ended: it is finished, and its worker goes back to `pool` (a thread's idle
        workers) unless the worker is dead, single-use, or the pool holds POOL_MAX already."""
        release(self, pool)


cdef object first_switch(MediatorCore mediator, worker, payload, list pool):
    # `start`'s switch into its body's `worker` with `payload` (a generator body's by a C
    # call): the body starts in the model's grad mode, the model gets its mode back after,
    # and a body that ended at once is released to `pool`
    mediator.worker = worker
    model_grad = _is_grad_enabled()
    mediator.body_grad = model_grad
    try:
        if isinstance(worker, GenCore):
            message = (<GenCore>worker).c_switch(payload)
        else:
            message = worker.switch(payload)
    finally:
        if _is_grad_enabled() != model_grad:
            _set_grad_enabled(model_grad)
    if message == 2 or message == 3:  # DONE, FAILED
        release(mediator, pool)
    return message


cdef int release(MediatorCore mediator, list pool) except -1:
    # MediatorCore.release, non-virtual (the exchange's common end of a body)
    worker = mediator.worker
    mediator.worker = None
    mediator.finished = True
    if (worker is not None and pool is not None and len(pool) < POOL_MAX
            and not worker.dead and not worker.single_use):
        pool.append(worker)
    return 0


cdef extern from "Python.h":
    ctypedef enum PySendResult:
        PYGEN_RETURN
        PYGEN_ERROR
        PYGEN_NEXT
    ctypedef struct PyObject
    PySendResult PyIter_Send(object iterator, object arg, PyObject **presult)
    Py_ssize_t PyNumber_AsSsize_t(object o, PyObject *exc)  # (exc NULL: clips, never raises for an int)
    object PyContext_CopyCurrent()
    int PyContext_Enter(object context) except -1
    int PyContext_Exit(object context) except -1


cdef class GenCore:
    """A generator body's worker, in `mediator.worker` (`intervention.mediator.GenWorker`
    subclasses it with the policy): `switch(payload)` sends `payload` into the body's
    generator `gen`, run in its own contextvars `context` as a greenlet would run in its own,
    and returns what the body yields (PARKED). When the body returns, `switch` ends it
    (`end()`) and returns `self.returned(value)`; when it raises, `self.failed(error)`
    (GeneratorExit propagates).
    The exchange resumes a GenCore by this C call, with no Python frame between the hook and
    the body (`Context.run(gen.send, payload)` in a method, as the twin does, is one frame
    and two calls more per resume: a sweep item resumes its body about three times).
    """

    cdef public object gen
    cdef public object context
    cdef public object token      # the body's save state entered in `context` (policy's)
    cdef public object mediator
    cdef public object home       # the greenlet that runs the model and resumes the body
    cdef public bint dead

    def __init__(self, mediator=None, gen=None, state=None):
        """With `gen`: the body's `context` is a copy of the caller's, its save state `state`
        entered there (`enter_body`, see `configure`), `home` the calling greenlet."""
        self.mediator = mediator
        self.gen = gen
        self.dead = False
        if gen is not None:
            context = self.context = PyContext_CopyCurrent()
            PyContext_Enter(context)
            try:
                self.token = _enter_body(state)
            finally:
                PyContext_Exit(context)
            self.home = _getcurrent()

    def end(self):
        """The body is over: `dead`, and its save state left (`exit_body`, in its context).
        `switch` does it before `returned`/`failed`."""
        self.c_end()

    cdef int c_end(self) except -1:
        self.dead = True
        token = self.token
        if token is not None:
            self.token = None
            context = self.context
            PyContext_Enter(context)
            try:
                _exit_body(token)
            finally:
                PyContext_Exit(context)
        return 0

    def returned(self, values):
        """`switch`'s end when the body returned its final locals `values`: its job's
        `finish(values)` (the mediator let go first: no cycle left; a plain job's, `plain_job`,
        taken here); DONE."""
        mediator = self.mediator
        self.mediator = None
        fn = (<MediatorCore?>mediator).fn
        if type(fn) is _plain_job and _plain_job.finish is _plain_finish:
            for name in _plain_hidden:
                del (<dict?>values)[name]
            (<dict?>fn.out).update(values)
        else:
            fn.finish(values)
        return 2  # DONE

    def switch(self, payload=None):
        return self.c_switch(payload)

    cdef object c_switch(self, payload):
        cdef PyObject *out = NULL
        cdef PySendResult sent
        context = self.context
        PyContext_Enter(context)
        try:
            sent = PyIter_Send(self.gen, payload, &out)
        finally:
            PyContext_Exit(context)
        if sent == PYGEN_NEXT:
            return _steal(out)
        if sent == PYGEN_RETURN:
            value = _steal(out)
            self.c_end()
            return self.returned(value)
        try:
            _raise_current()
        except GeneratorExit:
            raise
        except BaseException as error:  # reported to the model side by the policy
            self.c_end()
            return self.failed(error)


def envoy_reader(output, policy):
    """`Envoy.__interlace_read__` (intervention/envoy.py makes it once): a generator body's
    read `envoy.output` while a run of its model is on (the express run, else the general
    one: the Envoy's `_engine`) is that run's `reader(2 * _index + 1)`, when `type(envoy)`
    serves `output` with the Envoy's own property `output`; any other read is
    `policy(envoy, name)`. The common read with no Python frame."""

    def __interlace_read__(envoy, name):
        if name == "output" and type(envoy).output is output:
            fields = envoy.__dict__
            engine = fields["_engine"]
            run = engine.express
            if run is not None:  # (`ExpressCore.reader`, without its method call)
                return (<ExpressCore?>run).c_reader(2 * <Py_ssize_t>fields["_index"] + 1)
            run = engine.general_run
            if run is not None:
                return run.reader(2 * <Py_ssize_t>fields["_index"] + 1)
        return policy(envoy, name)

    return __interlace_read__


def envoy_writer(output, policy):
    """`Envoy.__interlace_write__` (intervention/envoy.py makes it once): a generator body's
    `envoy.output = value` while an express run of its model is on is that run's
    `writer(2 * _index + 1, value)`, when `type(envoy)` serves `output` with the Envoy's own
    property `output`; any other assignment is `policy(envoy, name, value)`. The common
    edit with no Python frame."""

    def __interlace_write__(envoy, name, value):
        if name == "output" and type(envoy).output is output:
            fields = envoy.__dict__
            run = fields["_engine"].express
            if run is not None:  # (`ExpressCore.writer`, without its method call)
                return (<ExpressCore?>run).c_writer(2 * <Py_ssize_t>fields["_index"] + 1, value)
        return policy(envoy, name, value)

    return __interlace_write__


def envoy_indexer(slow):
    """`Envoy.__getitem__` (intervention/envoy.py makes it once): `envoy[i]`, for an int `i`,
    is the child Envoy kept in the Envoy's `_positions` when the container's `_modules` still
    equal the copy kept there and the slot's Envoy was made before; anything else is
    `slow(envoy, key)`, which makes, checks and explains. The common `h[i]` with no Python
    frame."""

    def __getitem__(envoy, key):
        cdef Py_ssize_t i, n
        if type(key) is int:
            fields = envoy.__dict__
            positions = fields.get("_positions")
            if type(positions) is tuple and len(<tuple>positions) == 3:
                children = (<tuple>positions)[2]
                if (type(children) is list and
                        (<tuple>positions)[0] == fields["_module"].__dict__.get("_modules")):
                    n = len(<list>children)
                    i = PyNumber_AsSsize_t(key, NULL)  # (a huge int clips: out of range)
                    if i < 0:
                        i += n
                    if 0 <= i < n:
                        child = (<list>children)[i]
                        if child is not None:
                            return child
        return slow(envoy, key)

    return __getitem__


cdef extern from *:
    """
    /* `object.__new__(cls)` for a class made by `class` (what `cls()` makes before __init__):
       object's tp_new called directly, with no argument tuple made per call. */
    static PyObject *ilh_object_new(PyObject *cls) {
        static PyObject *no_args = NULL;
        if (no_args == NULL && (no_args = PyTuple_New(0)) == NULL) return NULL;
        return PyBaseObject_Type.tp_new((PyTypeObject *)cls, no_args, NULL);
    }
    """
    object ilh_object_new(object cls)


def tracer_maker(slow, cls, backend, unset):
    """`Model.trace` and `LanguageModel.trace` (models/ make each once): `model.trace(*inputs)`
    with no keyword makes the `cls` (InterleavingTracer) itself, its fields stored as its
    `__init__` stores them for that call (`args`, `backend`, `model`, the model's `engine`,
    then each name of `unset` as None), with no Python frame; a call with any keyword (`remote=`,
    `trace=`, `tracer_cls=`, the forward's own) is `slow(model, *inputs, **keywords)`'s."""
    def trace(model, *args, **kwargs):
        if kwargs:
            return slow(model, *args, **kwargs)
        tracer = ilh_object_new(cls)  # (`object.__new__(cls)`, with no builtin call)
        tracer.args = args
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
    `backend`, `parent`, then each name of `unset` as None), with no Python frame; every
    other call is `slow(tracer, *inputs, **keywords)`'s, which makes one with keywords or
    says why it may not."""
    def invoke(tracer, *args, **kwargs):
        if kwargs or not getattr(tracer, collecting) or tracer.args or tracer.kwargs:
            return slow(tracer, *args, **kwargs)
        invoker = ilh_object_new(cls)
        invoker.args = args
        invoker.backend = backend
        invoker.parent = tracer
        for name in unset:
            setattr(invoker, name, None)
        return invoker

    return invoke


def runs_here(MediatorCore mediator not None):
    """Is the calling code `mediator`'s body (its own lines or what they call)? A greenlet
    body runs on its worker; a generator body (a `GenCore` worker) runs while its generator
    does, on the greenlet that resumes it (the model's)."""
    worker = mediator.worker
    if worker is None:
        return False
    if isinstance(worker, GenCore):
        return bool((<GenCore>worker).gen.gi_running) and (<GenCore>worker).home is _getcurrent()
    return worker is _getcurrent()


cdef inline object _steal(PyObject *value):
    # a new reference from C, owned by the returned object from now on
    result = <object>value
    Py_DECREF(result)
    return result


cdef inline int _raise_current() except -1:
    # PyIter_Send returned PYGEN_ERROR: its error is set; `except -1` makes Cython raise it
    return -1



@cython.final
cdef class Event:
    """One happening of a location, as handed to bodies: its value may be replaced."""

    cdef public Py_ssize_t key
    cdef public Py_ssize_t occ
    cdef public object value
    cdef public bint replaced

    def __init__(self, Py_ssize_t key, Py_ssize_t occ, value):
        self.key = key
        self.occ = occ
        self.value = value
        self.replaced = False


cdef class Exchange:
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
    Ownership: every field is a strong reference; `end()` releases the per-run ones (hub,
    current, paused, routes); the policy callables stay until replaced (a subclass storing
    its own bound methods there holds itself: it clears them when its run is over).
    """

    cdef public Hub hub
    cdef public object current       # the mediator being served right now, or None
    cdef public Py_ssize_t bypass    # > 0: hooks ignore calls (a body calls a module itself)
    cdef public unsigned long thread
    cdef public object routed
    cdef public object message
    cdef public object paused
    cdef public bint done            # the run's model call is over: requests are refused
    cdef public bint root_call       # the run is one plain call of the root (its events by hand)
    cdef public Taps tapper          # sets the Taps of requests (None: all go to the policy)
    cdef public list pool            # set: a body that ends is released to it, no `message`
    cdef bytearray routes            # per key: non-zero sends its events to `routed`
    # A batched read's common case, taken here without calling `narrowed`: a value of exactly
    # `row_type` (the run's tensor type; None: never) in a run without `backward`, whose batch
    # axis `axes` (the run's cache, (key, shape) -> axis) holds as 0 is `value[rows]`.
    cdef public object row_type
    cdef public object axes
    cdef public bint backward
    cdef object is_grad_enabled
    cdef object set_grad_enabled
    cdef object getcurrent

    def __init__(self, is_grad_enabled, set_grad_enabled, routed=None, message=None,
                 getcurrent=None):
        self.row_type = None
        self.axes = None
        self.backward = False
        self.is_grad_enabled = is_grad_enabled
        self.set_grad_enabled = set_grad_enabled
        self.getcurrent = getcurrent
        self.done = False
        self.root_call = False
        self.tapper = None
        self.pool = None
        self.routed = routed
        self.message = message
        self.paused = None
        self.routes = bytearray()
        self.hub = None
        self.current = None
        self.bypass = 0
        self.thread = 0

    def begin(self, Hub hub not None, unsigned long thread, bint root_call=False, list pool=None):
        """A run starts: its hub, the thread its model runs in, whether it is one plain call
        of the root, and the idle-worker pool its ended bodies go back to (None: `message`
        hears of them). `done` is False until the run object says the model call is over."""
        self.hub = hub
        self.thread = thread
        self.root_call = root_call
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

    def route(self, Py_ssize_t key, bint on=True):
        """Send the events of `key` to `routed` (or stop sending them)."""
        cdef Py_ssize_t n = len(self.routes)
        if key >= n:
            if not on:
                return
            self.routes.extend(bytes(key + 1 - n))
        self.routes[key] = 1 if on else 0

    def grow(self, Py_ssize_t nkeys, visits=None, positions=None):
        """Make room in the hub for keys up to `nkeys` (locations added during the run), counted
        exactly from now on; `visits`/`positions`: the learned order's, grown with them."""
        cdef Hub hub = self.hub
        cdef Py_ssize_t missing
        if hub is None:
            raise RuntimeError("Exchange.grow() outside a run: call begin(hub, thread) first")
        missing = nkeys - len(hub.counts)
        if missing > 0:  # the hub indexes its tables unchecked: grow them before any fire
            hub.counts.extend([0] * missing)
            hub.exact.extend([True] * missing)
            if hub.visits is not None:
                hub.visits = visits
                hub.positions = positions

    def pre_hook(self, Py_ssize_t key):
        """The callable(module, args, kwargs) for a with-kwargs forward pre-hook at `key`."""
        return Hook(self, key, True).call  # a bound method: called without an argument tuple

    def post_hook(self, Py_ssize_t key):
        """The callable(module, args, output) for a forward hook at `key`."""
        return Hook(self, key, False).call

    def hook_event(self, Py_ssize_t key, bint pre, args, third):
        """What the hook at `key` does, called directly (a root call's events, fired by hand):
        `pre_hook(key)(module, args, third)` without making the hook."""
        return self.on_hook(key, pre, args, third)

    cdef object on_hook(self, Py_ssize_t key, bint pre, args, third):
        # One hook call; `third` is the pre-hook's kwargs or the forward hook's output.
        # args, third: borrowed from the hook call; returns a new reference (None: unchanged).
        cdef Hub hub = self.hub
        cdef Py_ssize_t occ
        cdef Event event
        if hub is None or self.bypass or PyThread_get_thread_ident() != self.thread:
            return None
        occ = hub.fire(key)
        if (key < PyByteArray_GET_SIZE(self.routes) and PyByteArray_AS_STRING(self.routes)[key]
                and self.routed is not None):
            return self.routed(key, occ, (args, third) if pre else third)
        waiters = hub.take(key, occ)
        if waiters is None:
            return None
        event = Event(key, occ, (args, third) if pre else third)
        self.c_serve(event, <list>waiters)
        if event.replaced:
            return event.value
        return None

    def handoff(self, Py_ssize_t key, value):
        """Location `key` happens with `value` (fired by hand, no hook): counts it and serves
        it; returns the `Event` as the bodies left it, or None when nobody waited."""
        cdef Hub hub = self.hub
        if hub is None:
            raise RuntimeError("Exchange.handoff() outside a run: call begin(hub, thread) first")
        return self.c_deliver(key, hub.fire(key), value)

    def deliver(self, Py_ssize_t key, Py_ssize_t occ, value):
        """Occurrence `occ` of `key` (already counted) has `value`: serves the bodies waiting
        for it; returns the `Event` as they left it, or None when nobody waited."""
        if self.hub is None:
            raise RuntimeError("Exchange.deliver() outside a run: call begin(hub, thread) first")
        return self.c_deliver(key, occ, value)

    cdef object c_deliver(self, Py_ssize_t key, Py_ssize_t occ, value):
        # value: borrowed; returns a new reference (an Event or None). self.hub is not None.
        cdef Event event
        waiters = self.hub.take(key, occ)
        if waiters is None:
            return None
        event = Event(key, occ, value)
        self.c_serve(event, <list>waiters)
        return event

    def serve(self, event, list waiters not None):
        """Hand `event` to each body in `waiters`, in invoke order (then `paused`, if set)."""
        self.c_serve(event, waiters)

    cdef object c_serve(self, event, list waiters):
        # event, waiters: borrowed (waiters is sorted in place); returns None (new reference).
        cdef Py_ssize_t i, j, n = len(waiters)
        cdef MediatorCore mediator
        if n > 1:  # insertion sort by invoke order: stable, and the lists are short
            for i in range(1, n):
                mediator = <MediatorCore?>waiters[i]
                j = i
                while j > 0 and (<MediatorCore?>waiters[j - 1]).index > mediator.index:
                    waiters[j] = waiters[j - 1]
                    j -= 1
                waiters[j] = mediator
        for i in range(n):
            mediator = <MediatorCore?>waiters[i]
            message = self.c_resume(mediator, event, None)
            if message != 1:  # 1: PARKED
                if message == 2 and self.pool is not None:  # 2: DONE, the common end
                    release(mediator, self.pool)
                elif self.message is not None:
                    self.message(mediator, message, event)
            if self.paused is not None:
                self.paused(mediator, event)

    def wait_for(self, MediatorCore mediator not None, Py_ssize_t key, Py_ssize_t occ):
        """Body side, from `mediator`'s greenlet: park it for occurrence `occ` of `key` and
        give control back to the model side (its greenlet's parent) with PARKED, noting the
        body's grad mode. Returns None once served (the event is then `mediator.event`);
        anything else the model side hands over goes through `mediator.received(payload)`
        (which raises the signal or error it is). One call for a request's whole wait."""
        cdef Hub hub = self.hub
        if hub is None:
            raise RuntimeError("Exchange.wait_for() outside a run: call begin(hub, thread) first")
        hub.park(key, occ, mediator)
        mediator.event = None
        mediator.body_grad = self.is_grad_enabled()
        return self.c_wait(mediator)

    cdef object c_wait(self, MediatorCore mediator):
        # the parked body's switch to the model side (counted), until it is served
        mediator.parks += 1
        payload = mediator.worker.parent.switch(PARKED)
        if payload is None:
            return None
        return mediator.received(payload)

    def request(self, Py_ssize_t key, mediator=None):
        """Body side: wait for location `key` at the occurrence `mediator`'s pointer names
        (default: the running body's); returns the `Event` it is served.

        Mechanism for the common case; the policy is the run object's own methods, called
        only when needed: `mediator(key)` (no mediator given: the running body's, or the
        error that says why there is none), `refuse(key, occ, passed, event)` (raises: the
        run is over, or that occurrence has passed) and `install_by_policy(key)` (when the
        `tapper` cannot set the Taps itself)."""
        if mediator is None:
            mediator = self.mediator(key)
        return self.c_request(<MediatorCore?>mediator, key)

    cdef object c_request(self, MediatorCore mediator, Py_ssize_t key):
        event = self.c_prepare(mediator, key)
        if event is not None:
            return event
        self.c_wait(mediator)  # switch to the model side, wait to be served
        return mediator.event

    def prepare(self, MediatorCore mediator not None, Py_ssize_t key):
        """Body side, for a generator body (which waits by yielding, not by switching):
        `request`'s work up to the wait. Returns the `Event` when the body is being served
        that occurrence already; else parks `mediator` for it, notes the body's grad mode and
        returns None (the body then yields PARKED; once resumed, `mediator.event` is it)."""
        return self.c_prepare(mediator, key)

    cdef object c_prepare(self, MediatorCore mediator, Py_ssize_t key):
        cdef Hub hub = self.hub
        cdef Py_ssize_t passed, occ
        cdef Pointer pointer = <Pointer?>mediator.pointer
        if hub is None:
            raise RuntimeError("Exchange.request() outside a run: call begin(hub, thread) first")
        event = mediator.event
        passed = hub.so_far(key)
        if event is not None and (<Event?>event).key == key:
            occ = pointer.bind((<Event>event).occ)
            if (<Event>event).occ == occ:
                return event
        else:
            occ = pointer.bind(passed)
        if self.done or occ < passed:
            self.refuse(key, occ, passed, event)  # raises
        if self.tapper is None or not self.tapper.c_install(self, key, self.root_call):
            self.install_by_policy(key)
        hub.park(key, occ, mediator)
        mediator.event = None
        mediator.body_grad = self.is_grad_enabled()
        return None

    def read(self, Py_ssize_t key):
        """Body side: the value of location `key` at the bound occurrence, as the running
        body sees it (its rows of a batch: the run object's `narrowed(event, mediator, key)`)."""
        cdef MediatorCore mediator = <MediatorCore?>self.current if self.current is not None else None
        if mediator is None or self.getcurrent is None or mediator.worker is not self.getcurrent():
            mediator = <MediatorCore?>self.mediator(key)  # raises: not the running body
        event = self.c_request(mediator, key)
        if mediator.rows is None:
            return (<Event?>event).value
        return self.c_narrowed(<Event?>event, mediator, key)

    cdef object c_narrowed(self, Event event, MediatorCore mediator, Py_ssize_t key):
        # `mediator`'s rows of `event`'s value: the common case (see `row_type`) here, else
        # the run object's `narrowed(event, mediator, key)`, the policy
        value = event.value
        if (self.row_type is not None and type(value) is self.row_type and not self.backward
                and type(self.axes) is dict):
            axis = (<dict>self.axes).get((key, value.shape))
            if axis is not None and axis == 0:
                return value[mediator.rows]
        return self.narrowed(event, mediator, key)

    def start_all(self, mediators):
        """Model side: run each body of `mediators`, in order, until its first request or its
        end (`mediator.start(pool)`, as `current`). A start that came back with anything but
        PARKED or DONE, or any start while the run has `participants`, goes to the run
        object's `_started(mediator, message)` (policy); the loop ends once the run is
        `stopped` or has a `failure` (the run object's fields)."""
        cdef object run = self
        pool = self.pool
        for mediator in mediators:
            self.current = mediator
            try:
                message = mediator.start(pool)
            finally:
                self.current = None
            if (message != 1 and message != 2) or run.participants:  # PARKED, DONE
                run._started(mediator, message)
            if run.stopped or run.failure is not None:
                return

    def reader(self, Py_ssize_t key):
        """Body side, for a generator body: what its `yield from` runs to read location
        `key` (`GenRead`) when the running body is a generator body on the model's greenlet
        (the common case); else the run object's `generator_read(key)`, which serves or
        refuses every other case."""
        cdef GenRead read
        mediator = self.current
        if mediator is not None and self.getcurrent is not None:
            worker = (<MediatorCore?>mediator).worker
            if (isinstance(worker, GenCore) and (<GenCore>worker).gen.gi_running
                    and (<GenCore>worker).home is self.getcurrent()):
                read = GenRead.__new__(GenRead)
                read.exchange = self
                read.mediator = <MediatorCore>mediator
                read.key = key
                return read
        return self.generator_read(key)

    def resume(self, MediatorCore mediator, event, payload=None):
        """Switch to `mediator`'s body with `payload` until it pauses; returns its message.

        While it runs, `current` is the mediator and its `event` is `event`; torch's grad mode
        is the body's, and the model's again afterwards, whatever the body did.
        """
        if mediator is None:
            raise TypeError("Exchange.resume() needs a mediator, got None")
        return self.c_resume(mediator, event, payload)

    cdef object c_resume(self, MediatorCore mediator, event, payload):
        # All borrowed; returns the body's message (a new reference). mediator is not None.
        cdef bint model_grad
        cdef object body_grad
        model_grad = self.is_grad_enabled()
        body_grad = mediator.body_grad
        self.current = mediator
        mediator.event = event
        try:
            if body_grad is not None and bool(body_grad) != model_grad:
                self.set_grad_enabled(bool(body_grad))
            worker = mediator.worker
            if isinstance(worker, GenCore):  # a generator body: resumed without a frame
                return (<GenCore>worker).c_switch(payload)
            return worker.switch(payload)
        finally:
            # Back on the model side: its grad mode again, whatever the body did.
            if bool(self.is_grad_enabled()) != model_grad:
                self.set_grad_enabled(model_grad)
            mediator.event = None
            self.current = None



@cython.final
cdef class GenRead:
    """One read of location `key` by a generator body, as the iterator its `yield from` runs
    (`Exchange.reader`): the request up to the park (`Exchange.prepare`), PARKED yielded
    while the value is not there, then the value, narrowed to the body's rows by the run
    object's `narrowed(event, mediator, key)`, returned (StopIteration). What the model side
    sends instead of None goes through `mediator.received(payload)` (which raises it).
    The Python generator it stands for (`Interleaver.generator_read`) is three frames and a
    generator object per read, about 80 bytecodes of them its own."""

    cdef Exchange exchange
    cdef MediatorCore mediator
    cdef Py_ssize_t key
    cdef bint parked

    def __iter__(self):
        return self

    def __next__(self):  # (the type's slot is `_genread_next`, below: this is for Python)
        return _return_or_yield(self, self.step(None))

    def send(self, payload):
        return _return_or_yield(self, self.step(payload))

    cdef object step(self, payload):
        # PARKED while the read waits (`mediator` kept), else the value read (`mediator` None)
        cdef MediatorCore mediator = self.mediator
        if mediator is None:
            raise StopIteration  # (already returned)
        if self.parked:
            if payload is not None:
                mediator.received(payload)  # raises the signal or error it is
            event = mediator.event
        else:
            event = self.exchange.c_prepare(mediator, self.key)
            if event is None:
                self.parked = True
                return PARKED
        exchange, self.exchange, self.mediator = self.exchange, None, None
        if mediator.rows is None:
            return (<Event?>event).value
        return exchange.c_narrowed(<Event?>event, mediator, self.key)


cdef extern from *:
    """
    /* Set StopIteration carrying `value`, as a generator's `return value` does (a tuple or
       an exception is wrapped in an instance, else it would be taken for the arguments). */
    static void ilh_set_return(PyObject *value) {
        if (PyTuple_Check(value) || PyExceptionInstance_Check(value)) {
            PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, value);
            if (stop == NULL) return;
            PyErr_SetObject(PyExc_StopIteration, stop);
            Py_DECREF(stop);
        } else {
            PyErr_SetObject(PyExc_StopIteration, value);
        }
    }
    """
    void ilh_set_return(object value)
    ctypedef PyObject *(*iternextfunc)(PyObject *) except NULL
    ctypedef struct _TypeSlots "PyTypeObject":
        iternextfunc tp_iternext


cdef object _return_or_yield(GenRead read, value):
    # `step`'s result as `__next__`/`send` give it to Python: a yield, or the read's return
    if read.mediator is not None:
        return value
    raise StopIteration(value)


cdef PyObject *_genread_next(PyObject *self) except NULL:
    # GenRead's tp_iternext (what `yield from` calls on each resume with None): `step`, its
    # return set as StopIteration by hand. (Raised from Cython, the StopIteration would get
    # a traceback entry made for it on every read: a code object and frame, several
    # thousand instructions.) An error of `step` propagates as Cython's do.
    cdef GenRead read = <GenRead>self
    value = read.step(None)
    if read.mediator is not None:
        Py_INCREF(value)
        return <PyObject *>value
    ilh_set_return(value)
    return NULL


(<_TypeSlots *>GenRead).tp_iternext = _genread_next


@cython.final
cdef class Hook:
    """A torch hook of one location: all of its work happens in `Exchange.on_hook`."""

    cdef readonly Exchange exchange
    cdef readonly Py_ssize_t key
    cdef readonly bint pre

    def __init__(self, Exchange exchange, Py_ssize_t key, bint pre):
        self.exchange = exchange
        self.key = key
        self.pre = pre

    def call(self, module, args, third):
        """The hook (`Exchange.pre_hook`/`post_hook` hand out this bound method: torch calls
        it through vectorcall, where calling the object itself would build an argument tuple)."""
        return self.exchange.on_hook(self.key, self.pre, args, third)

    def __call__(self, module, args, third):
        return self.exchange.on_hook(self.key, self.pre, args, third)


UNSET = object()
"""`Taps.tapped`'s "the module had no instance `forward`" (removing its Tap deletes the slot)."""

_OWN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@cython.final
cdef class Taps:
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

    cdef readonly dict handles
    cdef readonly dict taps
    cdef readonly dict tapped
    cdef list modules       # per module index: the module, its instance dict, its forward as
    cdef list dicts         # wrapped (None: the class's), its class once `know` said it takes
    cdef list forwards      # a Tap (None: not known yet)
    cdef list classes
    cdef tuple ancestors    # ModelState.ancestors
    cdef tuple global_hooks  # torch's global hook dicts (any entry: Python decides)
    cdef Py_ssize_t result_key
    cdef bint enabled

    def __init__(self, state, tuple global_hooks not None, bint enabled):
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
        self.enabled = enabled

    def know(self, Py_ssize_t index, cls):
        """Module `index` of class `cls` can have a Tap (Python checked the class once)."""
        self.classes[index] = cls

    cdef bint plain(self, Py_ssize_t index) except -1:
        # Can module `index` get (or already has) a Tap with no policy to apply?
        cdef dict instance
        if index in self.taps:
            return True
        if type(self.modules[index]) is not self.classes[index]:
            return False
        instance = <dict>self.dicts[index]
        if instance.get("forward") is not self.forwards[index]:
            return False
        for name in _OWN_HOOKS:
            if instance.get(name):
                return False
        return True

    def install(self, Exchange run not None, Py_ssize_t key, bint root_call):
        """Hook location `key` for `run` as `hooks.install` would, when every module on the way
        is plain (see the class); True when done or nothing was needed, False when Python must."""
        return self.c_install(run, key, root_call)

    cdef bint c_install(self, Exchange run, Py_ssize_t key, bint root_call) except -1:
        cdef Py_ssize_t index, ancestor
        cdef dict handles = self.handles
        cdef tuple chain
        if key in handles or key >= self.result_key or (key < 2 and root_call):
            return True
        if not self.enabled:
            return False
        for hooks in self.global_hooks:
            if hooks:
                return False
        index = key >> 1
        chain = <tuple>self.ancestors[index]
        for ancestor in chain:
            if 2 * ancestor not in handles and not (ancestor == 0 and root_call):
                if not self.plain(ancestor):
                    return False
        if not self.plain(index):
            return False
        for ancestor in chain:
            if 2 * ancestor not in handles and not (ancestor == 0 and root_call):
                self.tap(run, 2 * ancestor, ancestor)
        self.tap(run, key, index)
        return True

    cpdef tap(self, Exchange run, Py_ssize_t key, Py_ssize_t index):
        """Fire `key`'s events from module `index`'s Tap, set on it now unless this run has
        one there already (Python checked that the module may have one)."""
        cdef dict instance
        cdef Tap tap
        run.hub.observe(key)
        found = self.taps.get(index)
        if found is None:
            instance = <dict>self.dicts[index]
            current = instance.get("forward")
            tap = Tap(run, getattr(self.modules[index], "forward") if current is None else current)
            self.taps[index] = tap
            self.tapped[index] = (instance, UNSET if current is None else current)
            instance["forward"] = tap
        else:
            tap = <Tap?>found
        if key & 1:
            tap.post = key
        else:
            tap.pre = key
        self.handles[key] = None

    def remove(self):
        """Take every Tap off (one the user replaced since stays replaced) and forget the
        handles; returns the hook tokens among them (not None) for Python to detach, or None."""
        cdef Tap tap
        cdef dict instance
        tokens = None
        for token in self.handles.values():
            if token is not None:
                if tokens is None:
                    tokens = []
                tokens.append(token)
        self.handles.clear()
        if self.taps:
            for index, entry in self.tapped.items():
                instance, previous = entry
                tap = <Tap?>self.taps[index]
                tap.pre = tap.post = -1  # a reference kept somewhere fires nothing more
                if instance.get("forward") is tap:
                    if previous is UNSET:
                        del instance["forward"]
                    else:
                        instance["forward"] = previous
            self.taps.clear()
            self.tapped.clear()
        return tokens


cdef extern from "Python.h":
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf, PyObject *kwnames)
    Py_ssize_t PyVectorcall_NARGS(size_t nargsf)
    unsigned long Py_TPFLAGS_HAVE_VECTORCALL
    ctypedef struct _CallSlots "PyTypeObject":
        Py_ssize_t tp_vectorcall_offset
        unsigned long tp_flags


cdef class _Forwarding:
    """What a module's `forward` wrapper (`Tap`, `ExpressTap`) shows of the forward it wraps,
    `original`: `__wrapped__` (`inspect.signature` and `functools` look through it) and every
    other attribute (`module.forward.__func__`, `.__self__`, `.__name__`...)."""

    cdef public object original

    @property
    def __wrapped__(self):
        """The forward it wraps."""
        return self.original

    def __getattr__(self, name):
        return getattr(self.original, name)


@cython.final
cdef class Tap(_Forwarding):
    """A module's `forward` for one run: its input and output events, without torch hooks.

    torch runs a module's hooks only on its slow call path, which costs about what a small
    module's own work costs (~30k instructions a call, measured); a module with no hooks is
    called on the fast path, which calls `module.forward`: this, installed on the instance.
    It fires the input event (key `pre`; -1: none) before calling `original`, and the output
    event (`post`) after, through `Exchange.on_hook`, as the hooks would, with the same
    replacements. Keys are read at each call: one set while the module runs (a body asking
    for a container's output from inside it) is served when that call returns.
    """

    cdef void *vectorcall            # (the instance's vectorcall slot: `_tap_call`)
    cdef readonly Exchange exchange  # (`original`: what `module.forward` was, called with the
    cdef public Py_ssize_t pre       # edited input)
    cdef public Py_ssize_t post

    def __cinit__(self, *args, **kwargs):
        self.vectorcall = <void *>_tap_call

    def __init__(self, Exchange exchange not None, original):
        self.exchange = exchange
        self.original = original
        self.pre = -1
        self.post = -1

    def __call__(self, *args, **kwargs):
        # (only where a caller does not use vectorcall, and for an input event)
        return self.c_call(args, kwargs)

    cdef object c_call(self, tuple args, dict kwargs):
        cdef Py_ssize_t key = self.pre
        cdef object positional = args
        cdef object keywords = kwargs
        if key >= 0:
            replaced = self.exchange.on_hook(key, True, args, kwargs)
            if replaced is not None:
                positional, keywords = replaced
        output = self.original(*positional, **keywords)
        key = self.post
        if key >= 0:
            replaced = self.exchange.on_hook(key, False, positional, output)
            if replaced is not None:
                return replaced
        return output


cdef tuple _positional(PyObject **args, Py_ssize_t nargs):
    # a vectorcall's positional arguments as the tuple a hook gets
    return tuple([<object>args[i] for i in range(nargs)])


cdef object _tap_call(object callable, PyObject **args, size_t nargsf, PyObject *kwnames):
    # Tap's vectorcall: with no input event, the forward it wraps is called with the caller's
    # own argument vector (an output event does not use the arguments); an input event takes
    # them as the tuple and dict a pre-hook gets
    cdef Tap tap = <Tap>callable
    cdef Py_ssize_t nargs, i
    cdef dict keywords
    if tap.pre >= 0:
        nargs = PyVectorcall_NARGS(nargsf)
        keywords = {}
        if kwnames != NULL:
            names = <tuple>kwnames
            for i in range(len(names)):
                keywords[names[i]] = <object>args[nargs + i]
        return tap.c_call(_positional(args, nargs), keywords)
    output = PyObject_Vectorcall(tap.original, args, nargsf, kwnames)
    if tap.post >= 0:
        replaced = tap.exchange.on_hook(tap.post, False, None, output)
        if replaced is not None:
            return replaced
    return output


# ---- the express run's mechanism (intervention/express.py has its policy) ----

cdef extern from "Python.h":
    PyObject *PyWeakref_GetObject(object ref) except NULL

cdef extern from *:
    """
    /* The running Python frame (borrowed), as a plain object pointer to compare. */
    static PyObject *ilh_current_frame(void) { return (PyObject *)PyEval_GetFrame(); }
    """
    PyObject *ilh_current_frame()

# Where an express run is (`ExpressCore.stage`), in order.
BODY_START, FORWARD, RETURNED, ROOT_FIRED, RESULT_FIRED = range(5)
cdef enum:
    _FORWARD = 1  # (the same, for C)
    _RETURNED = 2
    _ROOT_FIRED = 3
    _RESULT_FIRED = 4


cdef extern from *:
    """
    #if defined(__GNUC__)
    #pragma GCC diagnostic push
    #pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    #endif
    /* A dict's version (PEP 509: globally unique, new at each change of the dict; deprecated
       from 3.12, still kept through 3.13) and a class's version tag (0: none; a change of
       the class or its bases drops it, and a lookup gives a new one, never reused). */
    static unsigned long long ilh_dict_version(PyObject *d) {
        return (unsigned long long)((PyDictObject *)d)->ma_version_tag;
    }
    #if defined(__GNUC__)
    #pragma GCC diagnostic pop
    #endif
    static unsigned int ilh_type_tag(PyObject *t) { return ((PyTypeObject *)t)->tp_version_tag; }
    """
    unsigned long long ilh_dict_version(dict d)
    unsigned int ilh_type_tag(object t)


@cython.final
cdef class PlanCheck:
    """What the checks of one entry of an express run's plan last found (`ExpressCore`): the
    module's instance dict as it stood checked (its version: no `forward`, no hooks, the hook
    dicts `hooks`), and the class's version tag when its `forward` was checked. Made empty
    (check in full) by the policy with each entry; only the compiled run fills it."""

    cdef unsigned long long version   # the instance dict's version as checked (0: unknown)
    cdef unsigned long long inserted  # its version once this run set the wrapper
    cdef unsigned int tag             # the class's version tag when checked (0: none)
    cdef tuple hooks                  # the instance's hook dicts (or None) as checked


cdef class ExpressCore:
    """An express run's fields, the run itself (`run`: the body started, the root called,
    the run ended) and the steps its wrappers and reads take per module, with no Python
    frame: `ahead` (can the run serve this key, wrappers set for it), `serve` (send a
    module's output into the body), `switch` (resume the body), `unwrap`. `run` leaves to
    the policy a body that fails or is handed over before the forward (`_raise`,
    `_general_from_start`), a root that returns while the body waits (`_after_return`) and
    a body's uncommon ends. `intervention.express.Express`
    subclasses it with the policy: `_wrap(index)` decides whether module `index` (and the
    modules containing it) may have a wrapper and records the decision as a *plan*
    (`plans[index]`: a tuple of `(index, module, instance dict, ExpressTap, class, class's
    forward, PlanCheck)`); later runs repeat only the plan's checks (no hooks of the module's own or
    global ones, no instance `forward`, the class and its `forward` as planned) and set its
    wrappers; any check that fails asks `_wrap` again. `_ended(values, error)` maps the
    body's end, `_failed(key)` raises for a body that failed while served, and
    `_served_over(key, value, message)` finishes a `serve` inside which the run was handed
    over; `generator_read(key)` is its read for every case `reader` does not serve, and
    `_read_over(key)` the general run's read for an `_ExpressRead` waiting at a hand-over
    (`handover` sent in). A subclass must not list these names in its `__slots__`.
    """

    cdef public Py_ssize_t want       # the key the waiting body reads next (-1: none)
    cdef public Py_ssize_t stage      # BODY_START... RESULT_FIRED
    cdef public Py_ssize_t position   # the learned position of the last value served
    cdef public Py_ssize_t result_key
    cdef public object positions      # ModelState.positions (per key, where it occurs)
    cdef public object interleaver    # the general run, once handed over
    cdef public object gen            # the body's generator and its contextvars context
    cdef public object context
    cdef public object body_grad      # the body's grad mode when it last paused
    cdef public dict wrapped          # index -> (instance dict, the wrapper this run set, its PlanCheck)
    cdef public dict plans            # index -> plan (see the class)
    cdef public list served           # module output keys served so far, in order (a replay)
    cdef public Py_ssize_t serving    # the key being served now (-1: none), its value, and
    cdef public object value          # whether the body replaced it
    cdef public bint replaced
    cdef tuple global_hooks
    cdef object handover              # what a hand-over sends into a waiting read
    # the run's own (the policy's fields, read and written by `run` and its end as struct
    # fields): the engine during a run, the model's state, the deferred body, the dict its
    # final locals go into, its save state's token, whether it ended, the general run's
    # worker after a hand-over, the body's error, the hand-over's event, the last write's
    # place, whether the general run cut the forward short
    cdef public object engine
    cdef public object state
    cdef public object body
    cdef public object out
    cdef public object token
    cdef public bint dead
    cdef public object worker
    cdef public object error
    cdef public object event
    cdef public object last_write
    cdef public bint cut

    def __init__(self, tuple global_hooks not None, handover=None):
        self.want = -1
        self.stage = 0
        self.position = -1
        self.result_key = 0
        self.wrapped = {}
        self.plans = {}
        self.served = []
        self.serving = -1
        self.replaced = False
        self.global_hooks = global_hooks
        self.handover = handover

    def reader(self, Py_ssize_t key):
        """Body side: what a generator body's `yield from` runs to read module output `key`
        (the Envoy's `.output`): when the body reads in its own frame, the value being
        served now, or a read of a key still ahead (`_ExpressRead`: yields `~key`; the value
        is `serve`'s); every other case is `generator_read(key)`'s (policy)."""
        return self.c_reader(key)

    def writer(self, Py_ssize_t key, value):
        """Body side: what a generator body's `yield from` runs to set module output `key`
        to `value` (the Envoy's `.output = value`): as `reader`, an `_ExpressRead` that
        makes the write (the run's `value`, `replaced`, `last_write`) once the key is served
        and returns None; every other case is `generator_write(key, value)`'s (policy)."""
        return self.c_writer(key, value)

    cdef object c_reader(self, Py_ssize_t key):
        # `reader`, also called from an Envoy's compiled read (`envoy_reader`)
        read = self.c_read(key)
        if read is None:
            return self.generator_read(key)
        return read

    cdef object c_writer(self, Py_ssize_t key, value):
        # `writer`, also called from an Envoy's compiled write (`envoy_writer`)
        cdef _ExpressRead read = self.c_read(key)
        if read is None:
            return self.generator_write(key, value)
        read.writes = True
        read.written = value
        return read

    cdef _ExpressRead c_read(self, Py_ssize_t key):
        # the compiled read of `key` when the body asks in its own frame and the run serves
        # the key now or later; else None (the policy's)
        cdef _ExpressRead read
        gen = self.gen
        if self.interleaver is None and gen is not None:
            frame = gen.gi_frame
            if <PyObject *>frame == ilh_current_frame():
                if key == self.serving or self.c_ahead(key):
                    read = _ExpressRead.__new__(_ExpressRead)
                    read.run = self
                    read.key = key
                    read.ready = key == self.serving
                    return read
        return None

    def ahead(self, Py_ssize_t key):
        """Can this run serve `key` (and are the wrappers for it set)?"""
        return self.c_ahead(key)

    cdef bint c_ahead(self, Py_ssize_t key) except -1:
        # (cdef, not cpdef: a cpdef method called from C on a Python subclass's instance
        # looks itself up by name on every call, to find an override)
        cdef Py_ssize_t result_key = self.result_key
        cdef int done
        if key == result_key:
            return self.stage < _RESULT_FIRED
        if key & 1 == 0 or key > result_key:
            return False  # an input (the general run serves them), an added location
        if key == 1:
            return self.stage < _ROOT_FIRED
        places = self.positions[key]
        if not places or <Py_ssize_t>places[0] <= self.position:
            return False  # it never runs, or its first occurrence has passed
        plan = self.plans.get(key >> 1)
        if plan is not None:
            done = self.c_wrap(<tuple>plan)
            if done >= 0:
                return done
        return self._wrap(key >> 1)

    cdef int c_wrap(self, tuple plan) except -2:
        # the plan's wrappers set (1); 0 when global hooks stop it; -1 when Python must decide.
        # An entry's checks are cut short by what its PlanCheck kept: the instance dict as the
        # last run left it (its version unchanged: no `forward`, the same hook dicts, whose
        # sizes are checked) and the class unchanged since its `forward` was checked (its
        # version tag); anything else is checked in full.
        cdef dict wrapped = self.wrapped
        cdef bint some = len(wrapped) != 0  # (a run's first read: no entry set yet)
        cdef dict instance
        cdef tuple entry
        cdef PlanCheck check
        cdef unsigned int tag
        for hooks in self.global_hooks:
            if hooks:
                return 0
        for entry in plan:
            if some and entry[0] in wrapped:
                continue
            instance = <dict>entry[2]
            check = <PlanCheck>entry[6]
            if type(entry[1]) is not entry[4]:
                return -1
            if check.version != 0 and ilh_dict_version(instance) == check.version:
                for hooks in check.hooks:
                    if hooks:
                        return -1
            else:
                check.version = 0
                if "forward" in instance:
                    return -1
                check.hooks = tuple([instance.get(name) for name in _OWN_HOOKS])
                for hooks in check.hooks:
                    if hooks:
                        return -1
                check.version = ilh_dict_version(instance)
            tag = ilh_type_tag(entry[4])
            if tag == 0 or tag != check.tag:
                if getattr(entry[4], "forward") is not entry[5]:
                    return -1
                check.tag = ilh_type_tag(entry[4])  # (the lookup gave the class a tag)
        for entry in plan:
            index = entry[0]
            if not some or index not in wrapped:
                instance = <dict>entry[2]
                check = <PlanCheck>entry[6]
                instance["forward"] = entry[3]
                check.inserted = ilh_dict_version(instance)
                wrapped[index] = (instance, entry[3], check)
        return 1

    def run(self, engine, body, out, args, kwargs):
        """Run the root on `args`/`kwargs` with `body` (a deferred body on the generator
        route) beside it, its final locals into `out`; the caller took `engine`'s lock for
        this thread, which this releases. The common run, start to end, with no Python
        frame; the policy's methods take every other case (`_general_from_start`, `_raise`,
        `_stopped`, `_model_failed` (after a write or a hand-over), `_after_return`,
        `_close_general`: after a hand-over, the general run's)."""
        self.engine = engine
        self.body = body
        self.out = out
        self.cut = self.dead = False
        eager = _eager_run()
        try:
            state = self.state
            # the body's contextvars are its own, and `.save()` saves into its save state
            self.token = self.c_begin(state.positions, state.result_key, body.generator(),
                                      body.state)
            engine.express = self
            message = self.c_switch(None)  # the body, up to its first read
            if self.interleaver is not None:
                return self._general_from_start(message, args, kwargs)
            if type(message) is int:
                if message == 3:  # FAILED
                    return self._raise()
                if message < 0:
                    self.want = ~<Py_ssize_t>message
            self.stage = _FORWARD
            try:
                result = state.root(*args, **kwargs)
            except _stops:  # a body failed in a wrapper (or stopped, handed over)
                return self._stopped()
            except Exception as error:
                if self.interleaver is not None or self.last_write is not None:
                    self._model_failed(error)  # (the policy names the body's last write)
                raise
            self.stage = _RETURNED
            if self.interleaver is None and self.want == -1:
                return result  # (the common end: the body ended inside the forward)
            return self._after_return(args, result)
        finally:
            self.c_close(eager)

    cdef c_close(self, eager):
        # take off what the run set, end a body that would not end, let the model go
        engine = self.engine
        interleaver = self.interleaver
        engine.express = None  # (a body's `finally` run below reads no express state)
        try:
            if interleaver is not None:
                self._close_general(interleaver)
            else:
                self.c_unwrap()
                if self.gen is not None and not self.dead:  # (the model raised while it waited)
                    self.dead = True
                    _close_body(self.gen, self.context, self.token)
        finally:
            self.c_end()
            self.body = self.out = self.token = self.worker = self.error = self.event = None
            self.last_write = self.engine = None
            engine.general_run = None
            engine.owner = None
            engine.lock.release()
            if eager is not None:
                _restore_eager(eager)
            if interleaver is not None and interleaver.reusable and len(engine.idle) < 2:
                engine.idle.append(interleaver)

    def begin(self, positions, Py_ssize_t result_key, gen, state):
        """A run's start: its fields as new, the model's learned `positions` (plans made
        for other ones forgotten), the body's generator `gen` to run in a copy of the
        caller's contextvars context with its save state `state` entered there
        (`enter_body`, see `configure`); returns that token."""
        return self.c_begin(positions, result_key, gen, state)

    cdef object c_begin(self, positions, Py_ssize_t result_key, gen, state):
        if positions is not self.positions:  # learned again: which modules run may differ
            self.plans.clear()
            self.positions = positions
        self.result_key = result_key
        self.stage = 0
        self.position = -1
        self.replaced = False
        self.gen = gen
        context = self.context = PyContext_CopyCurrent()
        PyContext_Enter(context)
        try:
            token = _enter_body(state)
        finally:
            PyContext_Exit(context)
        self.body_grad = _is_grad_enabled()
        return token

    def end(self):
        """A run's end: the fields let go of the body, its values and the general run."""
        self.c_end()

    cdef c_end(self):
        self.gen = self.context = self.value = self.interleaver = None
        if self.served:
            self.served.clear()
        self.want = self.serving = -1

    def unwrap(self):
        """Take off every wrapper this run set (one the user replaced since stays)."""
        self.c_unwrap()

    cdef c_unwrap(self):
        cdef dict instance
        cdef PlanCheck check
        for instance, wrapper, check in self.wrapped.values():
            if instance.get("forward") is wrapper:
                changed = ilh_dict_version(instance) != check.inserted  # (by others, meanwhile)
                del instance["forward"]
                # as checked again, unless something else changed it while the wrapper was set
                check.version = 0 if changed else ilh_dict_version(instance)
            else:
                check.version = 0
        self.wrapped.clear()

    def serve(self, Py_ssize_t key, value):
        """Send `value` (occurrence 0 of `key`) into the waiting body; returns the value as
        the body left it (a write replaces it). A body that failed: `_failed(key)`."""
        return self.c_serve(key, value)

    cdef object c_serve(self, Py_ssize_t key, value):
        self.want = -1
        if key != 1 and key != self.result_key:
            self.served.append(key)
            self.position = self.positions[key][0]
        self.serving = key
        self.value = value
        self.replaced = False
        message = self.c_switch(None)  # (the waiting read returns `value`, as it is then)
        if self.interleaver is not None:  # handed over while it ran: its policy finishes
            return self._served_over(key, value, message)
        self.serving = -1
        if self.replaced:
            value = self.value
        self.value = None
        if type(message) is int and message < 0:
            self.want = ~<Py_ssize_t>message
        elif message == FAILED:
            self._failed(key)
        return value

    def switch(self, payload):
        """Resume the body with `payload` until it reads (yields `~key`) or ends (then
        `_ended(values, error)`'s message), in its own grad mode and contextvars context.
        GeneratorExit propagates."""
        return self.c_switch(payload)

    cdef object c_switch(self, payload):
        cdef PyObject *out = NULL
        cdef PySendResult sent
        model_grad = _is_grad_enabled()
        if self.body_grad != model_grad:
            _set_grad_enabled(self.body_grad)
        try:
            context = self.context
            PyContext_Enter(context)
            try:
                sent = PyIter_Send(self.gen, payload, &out)
            finally:
                PyContext_Exit(context)
            payload = None
            if sent == PYGEN_NEXT:
                return _steal(out)
            if sent == PYGEN_RETURN:
                return self.c_returned(_steal(out))
            try:
                _raise_current()
            except GeneratorExit:
                raise
            except BaseException as error:  # reported to the model side by the policy
                return self._ended(None, error)
        finally:
            grad = _is_grad_enabled()
            self.body_grad = grad
            if grad != model_grad:
                _set_grad_enabled(model_grad)

    cdef object c_returned(self, values):
        # the body returned its final locals `values`: its common end (not handed over: its
        # save state left, its locals into `out`) here; every other is `_ended`'s
        if self.worker is not None or self.out is None or self.body is None:
            return self._ended(values, None)
        self.dead = True
        context = self.context
        PyContext_Enter(context)
        try:
            _exit_body(self.token)
        finally:
            PyContext_Exit(context)
        for name in _hidden:  # (`DeferredBody.generator_locals`, inline)
            del (<dict?>values)[name]
        (<dict?>self.out).update(values)
        return 2  # DONE


@cython.final
cdef class ExpressTap(_Forwarding):
    """Module `key >> 1`'s `forward` for its model's express runs (made once, set per run):
    calls the forward it wraps, then sends the output into the body when the run waits for
    it (`run.serve(key, output)`); after a hand-over the output is the general run's event.
    Holds its run weakly (the run keeps its wrappers); outside a run it is the forward.

    Called through vectorcall (`_express_tap_call`): torch's `forward_call(*args, **kwargs)`
    reaches the forward it wraps with the same argument vector, where a `__call__` taking
    `*args, **kwargs` copied the keywords into a new dict and unpacked it again for the
    call (about 1.2k instructions a call on a GPT-2 block, counted)."""

    cdef void *vectorcall  # (the instance's vectorcall slot: `_express_tap_call`)
    cdef object ref
    cdef readonly Py_ssize_t key

    def __cinit__(self, *args, **kwargs):
        self.vectorcall = <void *>_express_tap_call

    def __init__(self, ref, Py_ssize_t key, original):
        self.ref = ref
        self.key = key
        self.original = original

    def __call__(self, *args, **kwargs):
        # (only where a caller does not use vectorcall: the same steps)
        return self.c_after(self.original(*args, **kwargs), args, NULL, 0)

    cdef object c_after(self, output, tuple positional, PyObject **args, Py_ssize_t nargs):
        # the call returned `output`: serve it to a run waiting for it, or to the general run
        # (its event gets the call's positional arguments: `positional`, or made of `args`)
        found = <object>PyWeakref_GetObject(self.ref)
        if found is None:
            return output
        run = <ExpressCore?>found
        if run.want == self.key:
            return run.c_serve(self.key, output)
        interleaver = run.interleaver
        if interleaver is not None:  # handed over: this call's output is its event now
            if positional is None:
                positional = _positional(args, nargs)
            replaced = interleaver.hook_event(self.key, False, positional, output)
            if replaced is not None:
                return replaced
        return output


cdef object _express_tap_call(object callable, PyObject **args, size_t nargsf, PyObject *kwnames):
    # ExpressTap's vectorcall: the forward it wraps called with the caller's own vector
    cdef ExpressTap tap = <ExpressTap>callable
    output = PyObject_Vectorcall(tap.original, args, nargsf, kwnames)
    return tap.c_after(output, None, args, PyVectorcall_NARGS(nargsf))


cdef _use_vectorcall():
    # Tap's and ExpressTap's instances are called through their `vectorcall` field (set by
    # __cinit__; both classes are final: no subclass inherits the slot)
    cdef Tap tap = Tap.__new__(Tap)
    cdef ExpressTap express = ExpressTap.__new__(ExpressTap)
    (<_CallSlots *>Tap).tp_vectorcall_offset = <char *>&tap.vectorcall - <char *><void *>tap
    (<_CallSlots *>Tap).tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL
    (<_CallSlots *>ExpressTap).tp_vectorcall_offset = <char *>&express.vectorcall - <char *><void *>express
    (<_CallSlots *>ExpressTap).tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL


_use_vectorcall()


@cython.final
cdef class _ExpressRead:
    """One read of module output `key` by an express run's body, as the iterator its
    `yield from` runs (`ExpressCore.reader`): yields `~key`, and once the run's wrapper has
    served the key (resuming the body with None), returns the run's `value` (the output as
    served, or a write's replacement); `ready`: the value is being served now, returned at
    once. Sent `run.handover` while it waits (the run was handed over), it becomes the
    general run's read (`run._read_over(key)`) and forwards to it. The Python generator it
    stands for (`Express.generator_read`) is a generator object and a frame per read."""

    cdef ExpressCore run
    cdef Py_ssize_t key
    cdef bint ready
    cdef bint waiting
    cdef bint returned    # `step`'s result is the read's value (StopIteration), not a yield
    cdef object inner     # after a hand-over: the general run's read
    cdef bint writes      # a write (`ExpressCore.writer`) of `written`, not a read
    cdef object written

    def __iter__(self):
        return self

    def __next__(self):  # (the type's slot is `_expressread_next`, below: this is for Python)
        value = self.step(None)
        if self.returned:
            raise StopIteration(value)
        return value

    def send(self, payload):
        value = self.step(payload)
        if self.returned:
            raise StopIteration(value)
        return value

    cdef object step(self, payload):
        cdef PyObject *out = NULL
        cdef PySendResult sent
        cdef ExpressCore run = self.run
        if self.inner is not None:
            sent = PyIter_Send(self.inner, payload, &out)
            if sent == PYGEN_NEXT:
                self.returned = False
                return _steal(out)
            self.inner = None
            if sent == PYGEN_RETURN:
                self.returned = True
                return _steal(out)
            _raise_current()
        if run is None:
            raise StopIteration  # (already returned)
        if not self.ready:
            if not self.waiting:
                self.waiting = True
                self.returned = False
                return ~self.key
            if payload is not None and payload is run.handover:
                self.run = None
                if self.writes:
                    self.inner = run._read_over(self.key, self.written)
                    self.written = None
                else:
                    self.inner = run._read_over(self.key)
                return self.step(None)
        self.run = None
        self.returned = True
        if not self.writes:
            return run.value
        # the write, in the body's frame (its line is the assignment's)
        run.value, self.written = self.written, None
        run.replaced = True
        frame = run.gen.gi_frame
        run.last_write = (self.key, frame.f_code.co_filename, frame.f_lineno)
        return None


cdef PyObject *_expressread_next(PyObject *self) except NULL:
    # _ExpressRead's tp_iternext (what `yield from` calls on each resume with None): `step`,
    # its return set as StopIteration by hand (see `_genread_next`)
    cdef _ExpressRead read = <_ExpressRead>self
    value = read.step(None)
    if not read.returned:
        Py_INCREF(value)
        return <PyObject *>value
    ilh_set_return(value)
    return NULL


(<_TypeSlots *>_ExpressRead).tp_iternext = _expressread_next

# ---- end of the express run ----


# ---- call_below (h-sweep: a new worker greenlet's stack starts deep; see _chotpath_impl.c) ----

cdef extern from "_chotpath_impl.h":
    object ilh_call_below(Py_ssize_t depth, object fn)


def call_below(Py_ssize_t depth, fn):
    """Return fn(), called with `depth` bytes of this thread's C stack reserved below the
    caller (where the stack has room to spare for it; else a plain call). A greenlet first
    switched to inside starts that much deeper, below a model's forward that later resumes
    it, so that switching to it copies none of the forward's stack (mediator.py)."""
    return ilh_call_below(depth, fn)

# ---- end of call_below ----
