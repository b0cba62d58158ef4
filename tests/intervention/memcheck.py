"""Is everything of a run freed once the user lets go, by reference counting alone?

The reference is CPython itself: with the cyclic collector off (`gc.disable()`, no
`gc.collect()`), an object whose last reference goes is freed at once, and an object in a
reference cycle is not freed at all. So `weakref`s to the module, its wrapper and the saved
values must be dead as soon as the function that held them returns, and the number of live
tensors (every torch tensor with a Python object is gc-tracked, so `gc.get_objects()` sees it
even with the collector off) must be back where it was.
"""

import concurrent.futures
import contextlib
import gc
import weakref

import torch

from interlace.intervention import mediator


@contextlib.contextmanager
def collector_off():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def live_tensors():
    # issubclass(type(o)) rather than isinstance: isinstance reads `__class__`, and some
    # objects torch keeps (deprecated aliases) warn when it is read
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def watch(refs, name, value):
    """Add a weakref to `value` (a tensor, or the tensors in a list/tuple) under `name`."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            watch(refs, f"{name}[{i}]", item)
    elif isinstance(value, torch.Tensor):
        refs[name] = weakref.ref(value)


def assert_freed(run, where="main"):
    """`run()` builds a model, traces it and returns {name: weakref} of what it held.

    `where="main"` runs it in this thread with an empty greenlet pool, so that the traces
    use new greenlets (a new greenlet's first job is what a pooled greenlet used to keep);
    `where="thread"` runs it as the first work of a new thread that stays alive (a worker
    of a thread pool) while the check runs. Either way `run` is called once before, to
    create what torch and transformers build lazily on first use.
    """
    run()
    mediator.WORKERS.idle.clear()
    gc.collect()
    with collector_off():
        before = live_tensors()
        if where == "main":
            _check(run(), before)
        else:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                _check(pool.submit(run).result(), before)  # checked while the thread lives


def _check(refs, tensors_before):
    assert "module" in refs and "wrapper" in refs
    alive = sorted(name for name, ref in refs.items() if ref() is not None)
    assert not alive, f"still alive after the user let go (the collector is off): {alive}"
    left = live_tensors() - tensors_before
    assert left == 0, f"{left} tensor(s) of the run are still alive (the collector is off)"
