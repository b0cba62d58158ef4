"""`save()`: mark a value, by identity, to be pushed back to the caller when the trace ends.

The state belongs to the TRACE, not to the OS thread or greenlet that happens to run the
body: it lives in a ContextVar that `Tracer.run_body` sets itself, so a body run by a
mediator greenlet or a worker thread still saves into its own trace, and traces started from
different user threads never see each other's saves (each thread has its own context).

`.save()` works as a method on every object inside a trace, as in nnsight: a `save`
descriptor is mounted once, at import, in `object`'s own type dictionary (a static type's
dict is not writable from Python, hence `gc.get_referents` + `PyType_Modified` to drop the
stale method caches). A class's own `save` (e.g. PIL's `img.save(path)`) still wins: the MRO
finds it first. It is deliberately absent on modules and classes (see `ObjectSave`): pybind11
refuses to define a function named `save` where `getattr(scope, "save")` finds a non-function,
so a plain function on `object` makes `import torch` fail when torch is imported after
interlace. And it is taken off while any module is being imported (see
`_unmount_while_importing`): import-time code that walks `dir()` (torch's `__init__`,
anyio's `TypedAttributeSet`) would otherwise see it. The footgun that remains, as in nnsight:
every *instance* has a `save` attribute outside imports, so code that probes
`hasattr(x, "save")`, or a `__getattr__` that serves a field named `save`, sees ours.
"""

from __future__ import annotations

import contextvars
import ctypes
import gc
import sys
import threading
from types import MethodType as _MethodType
from types import ModuleType as _ModuleType

_NoneType = type(None)

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("interlace_trace", default=None)


class TraceState:
    """One trace's save set and nesting depth.

    `saved` maps id -> object (the object is kept so its id cannot be reused while the trace
    runs); nested traces share their outermost trace's `saved`, so a value saved deep inside
    is pushed out by every enclosing trace.
    """

    __slots__ = ("saved", "depth", "parent")

    def __init__(self, parent: TraceState | None):
        self.parent = parent
        if parent is None:
            self.saved = {}
            self.depth = 0
        else:
            self.saved = parent.saved
            self.depth = parent.depth + 1


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


def _object_save(self):
    """Mark this object to be kept after the trace (see `interlace.save`); returns it."""
    state = _CURRENT.get()
    if state is None:
        raise ValueError(
            f".save() was called on a {type(self).__name__} outside a trace: it marks a value inside a "
            f"`with ....trace(...):` block to keep after the block. Outside a trace, use the value directly."
        )
    state.saved[id(self)] = self
    return self


_object_save.__name__ = _object_save.__qualname__ = "save"


def _save_none():
    """`None.save()`."""
    return _object_save(None)


class ObjectSave:
    """The `save` attribute every object gets: `value.save()` binds `_object_save` to `value`.

    A non-data descriptor, so an instance's or a class's own `save` still wins. It is absent
    (AttributeError) on classes and on modules: binding generators test `hasattr(scope,
    "save")` before defining a `save` of their own (pybind11 refuses to overload a non-function
    attribute, so `import torch` after interlace would fail), and `SomeClass.save` probing
    should keep meaning "this class defines save".
    """

    __slots__ = ()

    def __get__(self, instance, owner=None):
        if instance is None:
            if owner is not _NoneType:  # `SomeClass.save` (`None.save` arrives as (None, NoneType))
                raise AttributeError("save")
            return _save_none  # a method cannot be bound to None
        if isinstance(instance, (type, _ModuleType)):
            raise AttributeError("save")
        return _MethodType(_object_save, instance)

    def __repr__(self):
        return "<interlace .save() on every object>"


OBJECT_SAVE_DESCRIPTOR = ObjectSave()


def _object_namespace():
    """`object`'s real type dict (the mappingproxy's referent)."""
    (namespace,) = [r for r in gc.get_referents(object.__dict__) if type(r) is dict]
    return namespace


def _set_mounted(mounted: bool) -> None:
    namespace = _object_namespace()
    if mounted:
        namespace["save"] = OBJECT_SAVE_DESCRIPTOR
    elif namespace.get("save") is OBJECT_SAVE_DESCRIPTOR:
        del namespace["save"]
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(object))  # drop stale method caches


def _mount_on_object() -> bool:
    """Put `save` in `object`'s type dict, once. Returns whether `.save()` is available."""
    if object.__dict__.get("save") is OBJECT_SAVE_DESCRIPTOR:
        return True
    try:
        if "save" in _object_namespace():  # somebody else's (e.g. nnsight): leave theirs alone
            return False
        _set_mounted(True)
    except Exception:  # noqa: BLE001 - not CPython, or no ctypes: `save(x)` still works
        return False
    _unmount_while_importing()
    return object.__dict__.get("save") is OBJECT_SAVE_DESCRIPTOR


_IMPORTING = [0]  # how many imports are executing (all threads); `save` is off while > 0
_IMPORT_LOCK = threading.RLock()


def _unmount_while_importing() -> None:
    """Run every module import with `save` taken off `object`, and put it back afterwards.

    Import-time code that enumerates `dir(...)` breaks when every object has a `save`:
    torch's `__init__` copies every attribute of `dir(torch._C._VariableFunctions)` into the
    `torch` namespace (it would overwrite `torch.save`), anyio's `TypedAttributeSet` subclasses
    refuse any attribute without an annotation (`import transformers` imports it). So the
    outermost import in progress (any thread) unmounts `save` and the last one to finish
    mounts it again: two `PyType_Modified` calls per top-level import statement, none per
    trace. It wraps `importlib._bootstrap._load_unlocked`, the one function every import
    statement and `importlib.import_module` go through to execute a new module. A trace
    running in another thread while a module is being imported loses `.save()` (not
    `save(x)`) for that moment; a class created at runtime whose creation walks `dir()`
    still sees `save`.
    """
    bootstrap = sys.modules.get("importlib._bootstrap")
    original = getattr(bootstrap, "_load_unlocked", None)
    if original is None or getattr(original, "_interlace_wrapped", False):
        return

    def _load_unlocked(spec):
        with _IMPORT_LOCK:
            _IMPORTING[0] += 1
            if _IMPORTING[0] == 1:
                _set_mounted(False)
        try:
            return original(spec)
        finally:
            with _IMPORT_LOCK:
                _IMPORTING[0] -= 1
                if _IMPORTING[0] == 0:
                    _set_mounted(True)

    _load_unlocked._interlace_wrapped = True
    _load_unlocked.__wrapped__ = original
    bootstrap._load_unlocked = _load_unlocked


OBJECT_SAVE = _mount_on_object()
