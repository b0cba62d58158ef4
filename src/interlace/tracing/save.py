"""`save()`: mark a value, by identity, to be pushed back to the caller when the trace ends.

The state belongs to the TRACE, not to the OS thread or greenlet that happens to run the
body: it lives in a ContextVar that `Tracer.run_body` sets (through `enter_body`), so a body
run by a mediator greenlet or a worker thread still saves into its own trace, and traces
started from different user threads never see each other's saves (each thread has its own
context).

`.save()` on every object (as in nnsight) is a descriptor in `object`'s own type dict. When
it is there, and why (docs/save.md has the long version):

* `import interlace` mounts nothing. The first trace body to run mounts it, and it stays.
* While a module is being imported and no trace body is running, it is taken off: import
  code that walks `dir()` would see it (torch's `__init__` copies every name of
  `dir(torch._C._VariableFunctions)` into `torch`; anyio's `TypedAttributeSet` refuses any
  attribute without an annotation; pybind11 refuses to define a method `save` where
  `getattr(cls, "save")` finds a non-function). A trace body that runs during an import (a
  module-level trace in an imported module) puts it back for as long as it runs, and so does
  one running in another thread: `.save()` never disappears under a running body.
* It chains, never clobbers: when it finds somebody else's `save` on `object` (nnsight
  0.8.1 mounts one at import and overwrites ours without chaining), it remembers it, mounts
  itself on top at the next trace body, and defers to it whenever no interlace trace is
  running here. Taking ours off puts theirs back.

The footgun that remains, as in nnsight: once mounted, every instance and every class has
a `save` attribute, so code that probes `hasattr(x, "save")` sees ours. Modules have none
(pybind11 checks `getattr(module, "save")` before defining a module-level `save`).
"""

from __future__ import annotations

import contextvars
import gc
import sys
import threading
from types import MethodType as _MethodType
from types import ModuleType as _ModuleType

from .. import _native

_frames = _native.frames

_NoneType = type(None)

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("interlace_trace", default=None)


# TraceState(parent): one trace's save set (`saved`, id -> object, kept so that an id cannot be
# reused while the trace runs; nested traces share their outermost trace's) and nesting
# `depth`. C fields natively, so that a warm trace makes it without a Python frame.
TraceState = _frames.TraceState


def current() -> TraceState | None:
    """The state of the trace whose body is running here, or None outside any trace body."""
    return _CURRENT.get()


def save(value):
    """Mark `value` (by identity) to be pushed back after the trace; returns `value` itself.

    Only this very object is saved: a value computed from it (`h + 1`, `h.clone()`) is not.
    """
    state = _CURRENT.get()
    if state is None:
        raise ValueError(
            "save() was called outside a trace: it marks a value inside a `with ....trace(...):` "
            "block to keep after the block. Outside a trace there is nothing to save; use the value directly."
        )
    state.saved[id(value)] = value
    return value


# Natively a builtin function: `save(value)` in a trace is one C call (no Python frame, no
# module globals touched: on the cache lines a forward left cold, a microsecond a trace);
# outside a trace, and a call with keywords, it is the function above.
save = _frames.function_save(save)


# -- `.save()` on every object ------------------------------------------------------------------
class _Mount:
    """The mount's process-wide state (guarded by `_LOCK`)."""

    active = False  # mounted once: from then on it stays, except during imports
    unavailable = False  # this interpreter does not let us write `object`'s dict
    displaced = None  # the `save` we found on `object` when we last went on (e.g. nnsight's)
    importing = 0  # imports executing now, all threads
    running: list = []  # one token per trace body running now, all threads and greenlets


_LOCK = threading.RLock()
_DEFERRING = threading.local()  # a displaced `save` that chains back to ours must not loop


def _object_save(self):
    """Mark this object to be kept after the trace (see `interlace.save`); returns it."""
    state = _CURRENT.get()
    if state is None:
        displaced = _Mount.displaced
        if displaced is not None and not getattr(_DEFERRING, "on", False):
            return _defer(displaced, self)
        raise ValueError(
            f".save() was called on a {type(self).__name__} outside a trace: it marks a value inside a "
            f"`with ....trace(...):` block to keep after the block. Outside a trace, use the value directly."
        )
    state.saved[id(self)] = self
    return self


_object_save.__name__ = _object_save.__qualname__ = "save"


def _defer(displaced, value):
    """Call the `save` we displaced, bound to `value`, as if ours had never been mounted."""
    _DEFERRING.on = True
    try:
        get = getattr(type(displaced), "__get__", None)
        if get is None:  # not a descriptor: an attribute found on the instance, used as is
            return displaced()
        if value is None:  # `None.save()`: a descriptor cannot bind None, pass it explicitly
            return get(displaced, None, _NoneType)(None)
        return get(displaced, value, type(value))()
    finally:
        _DEFERRING.on = False


def _save_none():
    """`None.save()`."""
    return _object_save(None)


class ObjectSave:
    """The `save` attribute every object gets: `value.save()` binds `_object_save` to `value`.

    A non-data descriptor, so an instance's or a class's own `save` still wins. On a class
    (`torch.Tensor.save`) it is the plain function, as a method is: `torch.compile` walks
    `dir(torch.Tensor)` and reads every name. Absent (AttributeError) on modules, and on
    classes while an import runs: pybind11 refuses to define a `save` where `getattr(scope,
    "save")` finds a non-function. When it displaced another `save`, a class sees that one.
    """

    __slots__ = ()

    def __get__(self, instance, owner=None):
        if instance is None:
            if owner is _NoneType:  # `None.save` arrives as (None, NoneType): bind by hand
                return _save_none
            displaced = _Mount.displaced
            if displaced is not None:
                get = getattr(type(displaced), "__get__", None)
                return displaced if get is None else get(displaced, None, owner)
            if _Mount.importing:
                raise AttributeError("save")
            return _object_save
        if isinstance(instance, (type, _ModuleType)):
            raise AttributeError("save")
        return _MethodType(_object_save, instance)

    def __repr__(self):
        return "<interlace .save() on every object>"


# Natively a C descriptor: `value.save()` is one C call that marks in the current trace's state;
# classes, modules and `.save()` outside a trace go to ObjectSave and `_object_save` above.
OBJECT_SAVE_DESCRIPTOR = _frames.object_save(ObjectSave(), _object_save)
_object_get = object.__dict__.get  # a live view of object's type dict


def _object_namespace():
    """`object`'s real type dict (the mappingproxy's referent)."""
    (namespace,) = [r for r in gc.get_referents(object.__dict__) if type(r) is dict]
    return namespace


def _type_modified() -> None:
    """Drop `object`'s stale method caches (ctypes loads here, at the first mount: importing
    it costs `import interlace` ~2 ms)."""
    import ctypes

    ctypes.pythonapi.PyType_Modified(ctypes.py_object(object))


def _put_on() -> None:
    """Mount ours on `object`, remembering what was there (under `_LOCK`)."""
    found = _object_get("save")
    if found is OBJECT_SAVE_DESCRIPTOR:
        return
    _Mount.displaced = found
    _object_namespace()["save"] = OBJECT_SAVE_DESCRIPTOR
    _type_modified()  # drop stale method caches


def _take_off() -> None:
    """Put back what ours displaced, if ours is on top (under `_LOCK`)."""
    if _object_get("save") is not OBJECT_SAVE_DESCRIPTOR:
        return  # not ours on top (somebody mounted over it): theirs stays
    namespace = _object_namespace()
    if _Mount.displaced is None:
        del namespace["save"]
    else:
        namespace["save"] = _Mount.displaced
    _type_modified()


def _sync() -> None:
    """Make `object.save` what it should be now: ours, unless an import runs and no body does."""
    if not _Mount.active:
        return
    if _Mount.importing and not _Mount.running:
        _take_off()
    else:
        _put_on()


def mount() -> bool:
    """Mount `.save()` on every object now (the first trace body does it); whether it is on.

    False when this interpreter does not let us (not CPython, no ctypes): `save(x)` still works.
    """
    with _LOCK:
        if not _Mount.active:
            if _Mount.unavailable:
                return False
            try:
                _object_namespace()
            except Exception:  # noqa: BLE001 - not CPython: say so once, not at every trace
                _Mount.unavailable = True
                return False
            _Mount.active = True
            _guard_imports()
        _sync()
    return _object_get("save") is OBJECT_SAVE_DESCRIPTOR


def _on_enter() -> None:
    """A body starts while `.save()` is off `object` or an import runs: mount it (once a trace
    body runs, `object.save` is ours until an import takes it off again)."""
    if not _Mount.unavailable:
        mount()


def _on_exit() -> None:
    """A body ends while an import runs: `object` gets its `save` back without ours."""
    with _LOCK:
        _sync()


# enter_body(state) -> token: make `state` the current trace here, with `.save()` mounted
# (per trace: a ContextVar set, a list append and an identity check; C natively).
# exit_body(token): undo it (same context); an import in progress gets `object` back without ours.
enter_body, exit_body = _frames.save_hooks(_CURRENT, _Mount.running, _Mount, OBJECT_SAVE_DESCRIPTOR,
                                           _on_enter, _on_exit)


def _guard_imports() -> None:
    """Run module imports with `save` off `object` while no trace body runs (see the module doc).

    Wraps `importlib._bootstrap._load_unlocked`, the one function every import statement and
    `importlib.import_module` go through to execute a new module: a lock and a dict lookup per
    import, and a `PyType_Modified` call where the state changes (a top-level import's start
    and end, when no body runs).
    """
    bootstrap = sys.modules.get("importlib._bootstrap")
    original = getattr(bootstrap, "_load_unlocked", None)
    if original is None or getattr(original, "_interlace_wrapped", False):
        return

    def _load_unlocked(spec):
        with _LOCK:
            _Mount.importing += 1
            _sync()
        try:
            return original(spec)
        finally:
            with _LOCK:
                _Mount.importing -= 1
                _sync()

    _load_unlocked._interlace_wrapped = True
    _load_unlocked.__wrapped__ = original
    bootstrap._load_unlocked = _load_unlocked
