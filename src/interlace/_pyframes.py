"""Pure-Python twin of `csrc/_cframes.pyx`: the frame-level mechanism of a skip.

Mechanism only (policy lives in `interlace.tracing.skip`). The twin cannot move a frame's
instruction pointer, so it *raises* `SkipSignal` at the body start, and the with's own
exception handler takes the frame to `__exit__`, which suppresses it:

* 3.12+: `sys.monitoring` LINE events, enabled once per code object for our own tool id;
  lines that do not start a with body are DISABLEd after their first event.
* 3.10/3.11: there is no `sys.monitoring`, so it needs a Python trace function
  (`sys.settrace` + the frame's `f_trace`), chained to whatever was installed. CPython
  uninstalls a trace function that raises, so the previous global and frame tracers are put
  back again by `disarm`, as well as CPython allows; coverage and pdb lose the rest of that
  frame on this path. This is why the twin refuses same-line and `try`-first bodies and why
  debugger tests are native-only.

Same names and signatures as the compiled module (see `_cframes.pyi`).
"""

from __future__ import annotations

import sys
import threading
import weakref

from . import versions as V

COMPILED = False

JUMP = 0
RAISE_LINE = 1
RAISE_INSTRUCTION = 2
OPCODE_EVENTS = 4   # a flag of arm's mode: the body start shares the with's line


class SkipSignal(BaseException):
    """Raised at a body start to leave the with block; only `skip.suppresses` ever sees it.

    A BaseException so that no `except Exception` between the frame and its `__exit__`
    can swallow it (there is none in CPython's with handler, but be safe).
    """


class TracerBase:
    """The Tracer's fields and __init__ (C fields and a C __init__ in the compiled module;
    plain attributes here, None until set)."""

    args = None       # the positional arguments the tracer was made with
    kwargs = None     # the keyword arguments but `backend`
    block = None      # the captured Block (kept after the run)
    backend = None    # called with the tracer after a clean skip
    _frame = None     # the caller's frame while the trace runs
    _plan = None      # its SkipPlan (None: the body runs inline)
    _parent = None    # the enclosing trace's state, read at __enter__
    _state = None     # this trace's TraceState, made when the body first runs
    _armed = None     # the armed skip from __enter__ until __exit__ disarms it

    def __init__(self, *args, backend=None, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.backend = _default_backend[0] if backend is None else backend

    def __del__(self):
        # A tracer that goes while armed (its __enter__ armed, then raised) disarms first.
        armed = self.__dict__.get("_armed")
        if armed is not None:
            self._armed = None
            _abandon(armed)


_default_backend = [None]  # what __init__ stores for backend=None (set by tracer_methods)


class _Armed:
    __slots__ = ("frame", "lo", "hi", "mode", "fired", "prev_global", "prev_local", "live")

    def __init__(self, frame, lo, hi, mode):
        self.frame = frame
        self.lo = lo
        self.hi = hi
        self.mode = mode
        self.fired = False
        self.live = True


_lock = threading.Lock()
_armed: dict = {}          # frame -> list of _Armed (3.12+ twin)
_stacked: set = set()      # armed handles not yet disarmed, all threads (the armed stacks)
# id(code) -> (weak reference to code, set(lines), set(units)); an entry goes with its code.
_starts: dict = {}
# id(code) -> (weak reference to code, {(lasti, id(tracer type)): (weak reference to the type,
# weak reference to the block, plan, arm_args)}): the twin's warm-site records (the compiled
# module keeps them on the code object). Weak, as there: a record must not keep the Block
# (whose body functions hold the globals that hold the code) or the type alive.
_sites: dict = {}
_look_past: dict = {}      # id(code) -> weak reference to a tracer's own __enter__ code


def _code_entry(table, code, make):
    """`table`'s entry for `code` (a (weak ref, value) pair that goes with the code), made by
    `make()` if missing."""
    key = id(code)
    entry = table.get(key)
    if entry is None or entry[0]() is not code:
        if make is None:
            return None

        def drop(ref, key=key):
            if table.get(key, (None,))[0] is ref:
                del table[key]

        entry = table[key] = (weakref.ref(code, drop), make())
    return entry


if V.HAS_MONITORING:
    _mon = sys.monitoring
    _tool = None

    def _tool_id():
        """Our sys.monitoring tool id: 4 if free, else the first free of 5, 3, 2 (0/1 are
        debugger/coverage by convention)."""
        global _tool
        if _tool is not None:
            return _tool
        for candidate in (4, 5, 3, 2):
            name = _mon.get_tool(candidate)
            if name == "interlace":
                _tool = candidate
                break
            if name is None:
                _mon.use_tool_id(candidate, "interlace")
                _tool = candidate
                break
        else:
            raise RuntimeError("interlace: no free sys.monitoring tool id among 2-5")
        _mon.register_callback(_tool, _mon.events.LINE, _on_line)
        _mon.register_callback(_tool, _mon.events.INSTRUCTION, _on_instruction)
        return _tool

    def _fire(frame, unit):
        records = _armed.get(frame)
        if records:
            rec = records[-1]
            if rec.live and rec.lo <= unit <= rec.hi:
                rec.fired = True
                rec.live = False
                raise SkipSignal()
        return False

    def _on_line(code, line):
        frame = sys._getframe(1)
        entry = _starts.get(id(code))
        if entry is None or line not in entry[1][0] or entry[0]() is not code:
            return _mon.DISABLE
        _fire(frame, frame.f_lasti // 2)
        return None

    def _on_instruction(code, offset):
        entry = _starts.get(id(code))
        if entry is None or offset // 2 not in entry[1][1] or entry[0]() is not code:
            return _mon.DISABLE
        _fire(sys._getframe(1), offset // 2)
        return None

    def prepare(code, line_units, instruction_units, lines, fused_prev_units=(), guard_units=()):
        """Enable our events on `code` for these body starts (once per code object). The twin
        guards no reads (native only: it refuses the shapes that need it)."""
        if guard_units:
            raise NotImplementedError("the pure-Python twin does not guard fused reads")
        tool = _tool_id()
        with _lock:
            entry = _code_entry(_starts, code, lambda: (set(), set()))[1]
            entry[0].update(lines)
            entry[1].update(instruction_units)
            events = _mon.events.LINE
            if entry[1]:
                events |= _mon.events.INSTRUCTION
            if _mon.get_local_events(tool, code) != events:
                _mon.set_local_events(tool, code, events)

    def arm(frame, lo, hi, exit_unit, mode):
        """Arm a skip of `frame` at units lo..hi; the twin always raises."""
        rec = _Armed(frame, lo, hi, mode)
        _armed.setdefault(frame, []).append(rec)
        _stacked.add(rec)
        return rec

    def _abandon(rec):
        """Disarm `rec` whenever its tracer goes (nothing else to put back here)."""
        disarm(rec)

    def disarm(rec):
        """Forget `rec`; True if its skip fired."""
        rec.live = False
        _stacked.discard(rec)
        records = _armed.get(rec.frame)
        if records is not None:
            try:
                records.remove(rec)
            except ValueError:
                pass
            if not records:
                _armed.pop(rec.frame, None)
        return rec.fired

else:  # 3.10 / 3.11: a chained Python trace function

    def _no_global(frame, event, arg):
        return None

    def prepare(code, line_units, instruction_units, lines, fused_prev_units=(), guard_units=()):
        """Nothing to prepare without sys.monitoring."""

    class _LocalTrace:
        """The armed frame's local trace function. An object returning itself, not a closure
        returning itself: that closure would be a reference cycle (function -> cell ->
        function) holding the record, hence the user's frame and its locals, until the
        cyclic collector runs."""

        __slots__ = ("rec",)

        def __init__(self, rec):
            self.rec = rec

        def __call__(self, f, event, arg):
            rec = self.rec
            if rec.live and f is rec.frame and event == "line" and rec.lo <= f.f_lasti // 2 <= rec.hi:
                rec.fired = True
                rec.live = False
                _restore(rec)
                raise SkipSignal()
            prev = rec.prev_local
            if prev is not None:
                rec.prev_local = prev(f, event, arg)
            if not rec.live:
                return rec.prev_local
            return self

    def arm(frame, lo, hi, exit_unit, mode):
        """Arm a skip of `frame` at units lo..hi by raising from its local trace function."""
        rec = _Armed(frame, lo, hi, mode)
        rec.prev_global = sys.gettrace()
        rec.prev_local = frame.f_trace
        frame.f_trace = _LocalTrace(rec)
        if rec.prev_global is None:
            sys.settrace(_no_global)
        _stacked.add(rec)
        return rec

    def _restore(rec):
        sys.settrace(rec.prev_global)
        rec.frame.f_trace = rec.prev_local

    def _abandon(rec):
        """Disarm `rec` whenever its tracer goes: put back only what is still ours (the
        program may have set other tracers since)."""
        if rec.live:
            rec.live = False
            if rec.prev_global is None and sys.gettrace() is _no_global:
                sys.settrace(None)
            local = rec.frame.f_trace
            if type(local) is _LocalTrace and local.rec is rec:
                rec.frame.f_trace = rec.prev_local
        _stacked.discard(rec)

    def disarm(rec):
        """Put back the tracers that were there before `arm`; True if the skip fired."""
        was_live = rec.live
        rec.live = False
        if was_live or (rec.fired and rec in _stacked):
            _restore(rec)
        _stacked.discard(rec)
        return rec.fired


def armed_count():
    """Armed handles not yet disarmed, on any thread. For leak tests."""
    return len(_stacked)


def warm_entries():
    """Tracer entries the compiled warm path served: the twin has none, so 0."""
    return 0


def register_site(code, lasti, kind, block, plan, arm_args=None):
    """Record what the policy decided for the with at `lasti` of `code`, for tracers of type
    `kind`: its Block, its SkipPlan and `arm_args`, or plan None for a body that runs inline.
    Goes when the code object goes."""
    record = (weakref.ref(kind), weakref.ref(block), plan, None if plan is None else tuple(arm_args))
    with _lock:
        sites = _code_entry(_sites, code, dict)[1]
        for key in [key for key, old in sites.items() if old[0]() is None or old[1]() is None]:
            del sites[key]  # records whose type or Block went
        sites[(lasti, id(kind))] = record


def site(code, lasti, kind):
    """The record `register_site` made: (block, plan, arm_args), or None (none, or its Block
    went)."""
    entry = _sites.get(id(code))
    record = None if entry is None or entry[0]() is not code else entry[1].get((lasti, id(kind)))
    if record is None or record[0]() is not kind:
        return None
    block = record[1]()
    return None if block is None else (block, record[2], record[3])


def look_past(code):
    """Mark `code` as a tracer's own __enter__: `user_frame` walks past its frames."""
    with _lock:
        _code_entry(_look_past, code, lambda: True)


def user_frame(frame):
    """`frame`, or its first caller whose code `look_past` did not mark."""
    while frame is not None and id(frame.f_code) in _look_past:
        if _look_past[id(frame.f_code)][0]() is not frame.f_code:
            break
        frame = frame.f_back
    return frame


def tracer_methods(cls, enter, exit, aenter, aexit, clean, current, default_backend):
    """(__enter__, __exit__, __aenter__, __aexit__) for `cls`: the twin has no warm path of its
    own, so these are the Python methods themselves (the compiled module returns C methods
    that serve a registered site, call `enter`/`exit` for the rest and leave no frame of
    theirs in a traceback). `default_backend`: what TracerBase.__init__ stores for
    `backend=None`."""
    _default_backend[0] = default_backend
    return enter, exit, aenter, aexit


def patch_checks(code, units, prev_units=()):
    """Native only: the twin cannot patch bytecode (it skips by raising instead)."""
    raise NotImplementedError("the pure-Python twin cannot patch bytecode")


def redirect(code, unit, delta):
    """Native only (see patch_checks)."""
    raise NotImplementedError("the pure-Python twin cannot patch bytecode")


def write_back(frame, values):
    """Write `values` into `frame`'s variables: fast locals and cells, module globals,
    or a class body's namespace. A function frame's `f_locals` snapshot (3.10-3.12), synced
    to write through it, is emptied after: it would keep every local of that moment alive
    (see `skip.release_locals`)."""
    if not values:
        return
    if not frame.f_code.co_flags & V.CO_OPTIMIZED:  # module or class body
        frame.f_locals.update(values)
        return
    if V.PY313_PLUS:
        proxy = frame.f_locals           # PEP 667 write-through proxy
        for name, value in values.items():
            proxy[name] = value
        return
    import ctypes

    f_locals = frame.f_locals
    f_locals.update(values)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
    f_locals.clear()


def bind(frame, names):
    """{name: value} for each of `names` (a tuple of str) that is bound in `frame` now, in
    `names` order: a function frame's variables (a cell's contents), a module's globals, a
    class body's namespace. The `f_locals` snapshot this reads a function frame through
    (3.10-3.12) is emptied after (see `skip.release_locals`), as the compiled `bind`, which
    reads the variables in place, leaves none."""
    scope = frame.f_locals  # module: its globals; class: its namespace
    # filter/map/zip, not comprehensions: no extra Python frame per trace on 3.10/3.11
    params = tuple(filter(scope.__contains__, names))
    out = dict(zip(params, map(scope.__getitem__, params)))
    if V.LOCALS_SNAPSHOT and frame.f_code.co_flags & V.CO_OPTIMIZED:
        scope.clear()
    return out


def call_bound(function, namespace, params):
    """`function(*[namespace[name] for name in params])`: how a deferred body's function is
    called with the names it was bound to."""
    return function(*map(namespace.__getitem__, params))


def pick(values, names, saved=None):
    """{name: values[name]} for each of `names` in `values` whose value is in `saved` (a
    trace's saved dict, id -> object) by identity; every one of them if `saved` is None.
    What a body's results write back into the caller."""
    out = {}  # loops, not comprehensions: no extra Python frame per trace on 3.10/3.11
    for name in names:
        if name in values and (saved is None or id(values[name]) in saved):
            out[name] = values[name]
    return out


class Reader:
    """`reader(obj, name)`: `type(obj).<method>(obj, name)` when the type has `method`, else
    `fallback(obj, name)`. A generator body's attribute read (tracing/generators.py), called
    for every read there (compiled: one C call, no Python frame)."""

    __slots__ = ("method", "fallback")

    def __init__(self, method, fallback):
        if type(method) is not str:
            raise TypeError(f"Argument 'method' has incorrect type (expected str, got {type(method).__name__})")
        self.method = method
        self.fallback = fallback

    def __call__(self, obj, name):
        serve = getattr(type(obj), self.method, None)
        if serve is None:
            return self.fallback(obj, name)
        return serve(obj, name)


class Writer:
    """`writer(value, obj, name)`: `type(obj).<method>(obj, name, value)` when the type has
    `method`, else `fallback(value, obj, name)`. A generator body's attribute assignment
    (tracing/generators.py), called for every one there (compiled: one C call, no Python
    frame)."""

    __slots__ = ("method", "fallback")

    def __init__(self, method, fallback):
        if type(method) is not str:
            raise TypeError(f"Argument 'method' has incorrect type (expected str, got {type(method).__name__})")
        self.method = method
        self.fallback = fallback

    def __call__(self, value, obj, name):
        serve = getattr(type(obj), self.method, None)
        if serve is None:
            return self.fallback(value, obj, name)
        return serve(obj, name, value)


# -- a trace's per-trace steps (C in the compiled module: no Python frame there) -------------
class TraceState:
    """One trace's save set and nesting depth.

    `saved` maps id -> object (the object is kept so its id cannot be reused while the trace
    runs); nested traces share their outermost trace's `saved`, so a value saved deep inside
    is pushed out by every enclosing trace.
    """

    __slots__ = ("saved", "depth", "parent")

    def __init__(self, parent):
        if parent is not None and not isinstance(parent, TraceState):
            raise TypeError(f"TraceState(parent): parent must be a TraceState or None, not {type(parent).__name__}")
        self.parent = parent
        if parent is None:
            self.saved = {}
            self.depth = 0
        else:
            self.saved = parent.saved
            self.depth = parent.depth + 1

    def __reduce__(self):
        return type(self), (None,), (self.saved, self.parent, self.depth)

    def __setstate__(self, state):
        self.saved, self.parent, self.depth = state


def save_hooks(current, running, mount, descriptor, on_enter, on_exit):
    """(enter_body, exit_body) over the ContextVar `current` and the list `running` (one
    token per running body); `on_enter()` runs when `.save()` is not mounted (`object.save`
    is not `descriptor`) or an import runs (`mount.importing`), `on_exit()` when an import
    runs at exit. The compiled module's are C functions."""
    set_current, reset_current = current.set, current.reset
    append, remove = running.append, running.remove
    object_get = object.__dict__.get  # a live view of object's type dict

    def enter_body(state):
        """Make `state` the current trace here, with `.save()` mounted; a token for exit_body."""
        token = set_current(state)
        append(token)  # (list.append/remove are atomic; tokens are unhashable)
        # Checked after registering this body: an import starting now sees it (and keeps ours on).
        if mount.importing or object_get("save") is not descriptor:
            try:
                on_enter()
            except BaseException:
                remove(token)
                reset_current(token)
                raise
        return token

    def exit_body(token):
        """Undo enter_body (same context)."""
        try:
            remove(token)
            if mount.importing:
                on_exit()
        finally:
            reset_current(token)

    return enter_body, exit_body


class DeferredBase:
    """A deferred body's fields (C fields in the compiled module, read there by offset)."""

    __slots__ = ("tracer", "block", "namespace", "globals", "state", "_params", "_code", "_entry")

    def __init__(self, tracer, namespace, globals_, state, _params=None):
        block = self.block = tracer.block
        self.tracer = tracer
        self.namespace = namespace
        self.globals = globals_
        self.state = state
        # the body's parameters: the names of `namespace` it mentions, in `block.names` order
        self._params = tuple(filter(namespace.__contains__, block.names)) if _params is None else _params
        self._code = None  # the code object the latest run executes (to find its frame)
        self._entry = None  # the namespace the latest run started from


def deferred_methods(tracer_cls, deferred_cls, defer, push_result, run, locals_param):
    """(Tracer.defer, Tracer.push_result, DeferredBody.run): the twin has no warm path of its
    own, so these are the Python methods themselves (the compiled module returns C methods
    that serve the warm case and call these for the rest)."""
    return defer, push_result, run


def generator_method(deferred_cls, generator):
    """`DeferredBody.generator`: the twin's is the Python method itself (the compiled module
    returns a C method that starts a warm site's body and calls it for the rest)."""
    return generator


def object_save(descriptor, save):
    """The descriptor to mount as `object.save`: the twin's is `descriptor` itself (the
    compiled module's is a C one whose bound method marks in C)."""
    return descriptor


def function_save(save):
    """`interlace.save`: the twin's is the Python function itself (the compiled module's is
    a builtin function that marks in C)."""
    return save
