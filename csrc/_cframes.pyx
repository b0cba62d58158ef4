# cython: language_level=3
"""Frame-level mechanism of a skip (compiled). Policy lives in interlace.tracing.skip.

Same names and behaviour as the pure-Python twin `interlace._pyframes`; the C half is in
`_cframes_impl.c` (every function there states what it borrows and returns).
"""

import threading
import weakref

from interlace.versions import HAS_MONITORING

cdef extern from "_cframes_impl.h":
    int ilc_init(object skip_signal) except -1
    object ilc_arm(object frame, int lo, int hi, int exit_unit, int mode)
    int ilc_disarm(object handle) except -1
    int ilc_fire() except -1
    int ilc_patch_check(object code, int unit, int prev_unit) except -1
    int ilc_split_super(object code, int unit) except -1
    int ilc_redirect(object code, int unit, int delta) except -1
    int ilc_guard(object code, int unit) except -1
    Py_ssize_t ilc_armed_count()
    Py_ssize_t ilc_warm_entries()
    int ilc_register_site(object code, int lasti, object kind, object block, object plan,
                          int lo, int hi, int exit_unit, int mode) except -1
    int ilc_look_past(object code) except -1
    object ilc_site(object code, int lasti, object kind)
    object ilc_user_frame(object frame)
    object ilc_bind(object frame, object names)
    int ilc_write_back(object frame, object values) except -1
    object ilc_call_bound(object function, object namespace, object params)
    object ilc_pick(object values, object names, object saved)
    object ilc_tracer_base()
    object ilc_tracer_methods(object type, object enter, object exit, object clean, object current,
                              object default_backend)
    object ilc_trace_state_type()
    object ilc_save_hooks(object current, object running, object mount, object descriptor,
                          object on_enter, object on_exit)
    object ilc_deferred_base()
    object ilc_deferred_methods(object tracer_cls, object deferred_cls, object defer, object push,
                                object run, object locals_param)
    object ilc_object_save(object descriptor, object save)
    object ilc_function_save(object save)
    object ilc_generator_method(object deferred_cls, object generator)

COMPILED = True

JUMP = 0
RAISE_LINE = 1
RAISE_INSTRUCTION = 2
OPCODE_EVENTS = 4   # a flag of arm's mode: the body start shares the with's line


class SkipSignal(BaseException):
    """Raised at a body start (raise mode) to leave the with block; only
    `skip.suppresses` ever sees it. A BaseException so no `except Exception` swallows it."""


ilc_init(SkipSignal)

TracerBase = ilc_tracer_base()   # the Tracer's per-run fields in C (see _cframes_impl.c)
TraceState = ilc_trace_state_type()   # one trace's save set and depth (C fields)
DeferredBase = ilc_deferred_base()    # a deferred body's fields (C fields)

_lock = threading.Lock()
# id(code) -> (weak reference to code, set(lines), set(units), set(guard units)); an entry
# goes with its code object.
_starts = {}
_tool = None
_DISABLE = None


def arm(frame, int lo, int hi, int exit_unit, int mode):
    """Arm a skip of `frame` at body units lo..hi; returns the handle for `disarm`, which
    stays on this thread's armed stack until then.

    JUMP moves the frame to `exit_unit`; the RAISE modes raise SkipSignal instead."""
    return ilc_arm(frame, lo, hi, exit_unit, mode)


def disarm(handle):
    """Undo `arm` (restoring any chained tracer); True if the skip fired."""
    return ilc_disarm(handle) == 1


def tracer_methods(cls, enter, exit, aenter, aexit, clean, current, default_backend):
    """(__enter__, __exit__, __aenter__, __aexit__) for `cls` (the Tracer, a TracerBase):
    C methods that do a registered site's mechanism (set the per-run fields, arm, disarm,
    call the backend) and call the Python methods `enter(self, frame)` /
    `exit(self, t, v, tb, fired)` for the rest (policy). Every error leaving them goes
    through `clean(error, signal)` first (it drops interlace's frames), so no interlace frame
    is in its traceback. The C __aenter__/__aexit__ call __enter__/__exit__ and return a done
    awaitable; the Python `aenter`/`aexit` are the twin's (unused here). `current` is the
    trace-state ContextVar whose value becomes the tracer's `_parent`; `default_backend` is
    what TracerBase.__init__ stores for `backend=None`."""
    return ilc_tracer_methods(cls, enter, exit, clean, current, default_backend)


def save_hooks(current, running, mount, descriptor, on_enter, on_exit):
    """(enter_body, exit_body): C functions that make a TraceState the current trace (the
    ContextVar `current`), keep a token per running body in the list `running`, and call
    the Python `on_enter()` when `.save()` is not mounted (`object.save` is not `descriptor`)
    or an import runs (`mount.importing`), and `on_exit()` when an import runs at exit."""
    return ilc_save_hooks(current, running, mount, descriptor, on_enter, on_exit)


def deferred_methods(tracer_cls, deferred_cls, defer, push_result, run, locals_param):
    """(Tracer.defer, Tracer.push_result, DeferredBody.run) as C methods: the warm case of
    each (a plain `defer()` while __exit__ runs; a push; a plain `run()` whose body function
    the site's previous run left on the Block) with no Python frame; everything else calls
    the Python method given, with the same arguments. The twin returns the three unchanged."""
    return ilc_deferred_methods(tracer_cls, deferred_cls, defer, push_result, run, locals_param)


def generator_method(deferred_cls, generator):
    """`DeferredBody.generator` as a C method: a site whose previous start left its generator
    function on the Block (`last_generator`, for the same params and globals) starts the
    body with no Python frame; everything else calls the Python method given. The twin
    returns `generator` unchanged."""
    return ilc_generator_method(deferred_cls, generator)


def object_save(descriptor, save):
    """The descriptor to mount as `object.save`: natively a C one whose bound method marks in
    C (one call, no Python frame); outside a trace it calls `save(value)`, and classes and
    modules get `descriptor`'s own __get__. The twin returns `descriptor` unchanged."""
    return ilc_object_save(descriptor, save)


def function_save(save):
    """`interlace.save` as a builtin function: `save(value)` marks `value` in the current
    trace's state with no Python frame; outside a trace, and any call with keywords, it is
    the Python function `save`'s. The twin returns `save` unchanged."""
    return ilc_function_save(save)


def register_site(code, int lasti, kind, block, plan, arm_args=None):
    """Record what the policy decided for the with at `lasti` of `code`, for tracers of type
    `kind`: its Block, its SkipPlan and `arm_args` (lo, hi, exit, mode), or plan None for a
    body that runs inline. Kept on the code object (co_extra), so it goes when the code
    object goes; the Block and the type are held weakly (a record whose Block went is a
    miss), since the code object cannot be part of a cycle the collector sees."""
    if plan is None:
        ilc_register_site(code, lasti, kind, block, None, -1, -1, -1, 0)
    else:
        lo, hi, exit_unit, mode = arm_args
        ilc_register_site(code, lasti, kind, block, plan, lo, hi, exit_unit, mode)


def site(code, int lasti, kind):
    """The record `register_site` made: (block, plan, arm_args), or None."""
    return ilc_site(code, lasti, kind)


def look_past(code):
    """Mark `code` as a tracer's own __enter__ (a subclass's calling super().__enter__()):
    `user_frame` and the warm path walk past its frames to the user's."""
    ilc_look_past(code)


def user_frame(frame):
    """`frame`, or its first caller whose code `look_past` did not mark."""
    return ilc_user_frame(frame)


def warm_entries():
    """Tracer entries the compiled warm path served since import (the twin has none: 0)."""
    return ilc_warm_entries()


def armed_count():
    """Armed handles not yet disarmed, on any thread's armed stack. For leak tests."""
    return ilc_armed_count()


def patch_checks(code, units, prev_units=()):
    """3.12+: make the reads at `units` LOAD_FAST_CHECK (splitting quickened pairs that
    start at the matching `prev_units`, -1 for none). Returns how many were patched."""
    cdef int n = 0
    prevs = list(prev_units) + [-1] * (len(units) - len(prev_units))
    for unit, prev in zip(units, prevs):
        n += ilc_patch_check(code, unit, prev)
    return n


def redirect(code, int unit, int delta):
    """3.13: make the fused read at `unit` a JUMP_FORWARD `delta` into the handler's
    (checked) copy of the same tail."""
    ilc_redirect(code, unit, delta)


def write_back(frame, values):
    """Write `values` into `frame`'s variables: fast locals and cells, module globals,
    or a class body's namespace. A function frame's variables are written in place
    (3.10-3.12; 3.13 through its write-through `f_locals` proxy), and an `f_locals`
    snapshot an earlier read left on it is emptied: it would keep every local of that
    moment alive (see `skip.release_locals`)."""
    ilc_write_back(frame, values)


def bind(frame, names):
    """{name: value} for each of `names` (a tuple of str) that is bound in `frame` now, in
    `names` order: a function frame's variables (a cell's contents), a module's globals, a
    class body's namespace. Leaves no `f_locals` snapshot on a function frame (3.10-3.12:
    the variables are read in place, and a snapshot an earlier read left is emptied)."""
    return ilc_bind(frame, names)


def call_bound(function, namespace, params):
    """`function(*[namespace[name] for name in params])`, without the argument tuple: how a
    deferred body's function is called with the names it was bound to."""
    return ilc_call_bound(function, namespace, params)


def pick(values, names, saved=None):
    """{name: values[name]} for each of `names` in `values` whose value is in `saved` (a
    trace's saved dict, id -> object) by identity; every one of them if `saved` is None.
    What a body's results write back into the caller."""
    return ilc_pick(values, names, saved)


cdef class Reader:
    """`reader(obj, name)`: `type(obj).<method>(obj, name)` when the type has `method`, else
    `fallback(obj, name)`. A generator body's attribute read (tracing/generators.py), called
    for every read there: one C call, no Python frame."""

    cdef object method
    cdef object fallback

    def __init__(self, str method, fallback):
        self.method = method
        self.fallback = fallback

    def __call__(self, obj, name):
        serve = getattr(type(obj), self.method, None)
        if serve is None:
            return self.fallback(obj, name)
        return serve(obj, name)


cdef class Writer:
    """`writer(value, obj, name)`: `type(obj).<method>(obj, name, value)` when the type has
    `method`, else `fallback(value, obj, name)`. A generator body's attribute assignment
    (tracing/generators.py), called for every one there: one C call, no Python frame."""

    cdef object method
    cdef object fallback

    def __init__(self, str method, fallback):
        self.method = method
        self.fallback = fallback

    def __call__(self, value, obj, name):
        serve = getattr(type(obj), self.method, None)
        if serve is None:
            return self.fallback(value, obj, name)
        return serve(obj, name, value)


def _forget_starts(ref, key):
    """A monitored code object went: drop its entry (unless a new one has its id)."""
    entry = _starts.get(key)
    if entry is not None and entry[0] is ref:
        del _starts[key]


if HAS_MONITORING:
    import sys

    _mon = sys.monitoring
    _DISABLE = _mon.DISABLE

    def _tool_id():
        """Our sys.monitoring tool id: 4 if free, else the first free of 5, 3, 2."""
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

    def _on_line(code, line):
        if ilc_fire() == 1:
            return None
        entry = _starts.get(id(code))
        if entry is None or line not in entry[1] or entry[0]() is not code:
            return _DISABLE
        return None

    def _on_instruction(code, offset):
        entry = _starts.get(id(code))
        if entry is None or entry[0]() is not code:
            return _DISABLE
        unit = offset // 2
        guarded = unit in entry[3]
        if guarded:
            ilc_guard(code, unit)  # UnboundLocalError, as inline, if a read local is unbound
        if unit in entry[2]:
            ilc_fire()
        elif not guarded:
            return _DISABLE
        return None

    def prepare(code, line_units, instruction_units, lines, fused_prev_units=(), guard_units=()):
        """Enable our events on `code` for these body starts (once per code object), split
        a quickened pair in front of a body start so its own event fires (3.12), and guard
        the fused reads at `guard_units` (3.13: an unbound local raises UnboundLocalError
        there instead of being read unchecked)."""
        tool = _tool_id()
        with _lock:
            entry = _starts.get(id(code))
            if entry is None or entry[0]() is not code:
                key = id(code)
                ref = weakref.ref(code, lambda ref, key=key: _forget_starts(ref, key))
                entry = _starts[key] = (ref, set(), set(), set())
            for unit in fused_prev_units:
                ilc_split_super(code, unit)
            entry[1].update(lines)
            entry[2].update(instruction_units)
            entry[3].update(guard_units)
            events = _mon.events.LINE
            if entry[2] or entry[3]:
                events |= _mon.events.INSTRUCTION
            if _mon.get_local_events(tool, code) != events:
                _mon.set_local_events(tool, code, events)
else:
    def prepare(code, line_units, instruction_units, lines, fused_prev_units=(), guard_units=()):
        """Nothing to prepare on 3.10/3.11: the one-shot trace function needs no setup."""
