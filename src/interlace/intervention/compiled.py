"""Inside a trace, `torch.compile`d modules and functions run eagerly.

A compiled graph runs none of the hooks a trace puts on the modules inside it (dynamo does
not guard on hooks added after it compiled: `skip_nnmodule_hook_guards`), so reading a
submodule of a compiled model would find nothing, and an edit would be silently lost. So
while a trace runs its model, dynamo's stance is "force_eager" (what
`torch.compiler.set_stance("force_eager")` sets): every compiled callable runs its original
Python code, hooks and all, with the same values. Outside traces nothing changes: the
compiled code runs at full speed, and it is not recompiled because of a trace.

Only processes that have called `torch.compile` pay anything (torch's own `disable`
wrappers do not count), and the stance is process-wide: a compiled model running in another
thread during a trace also runs eagerly for that time (same values, less speed).
"""

from __future__ import annotations

import sys
import threading

_LOCK = threading.Lock()


class _Eager:
    depth = 0  # traces running their model now, all threads
    prior = None  # the entered `set_stance` whose exit puts the prior stance back
    seen = 0  # len(cached_backends) when `compiled` was last computed
    compiled = False


def _dynamo_has_compiled(eval_frame) -> bool:
    """Whether `torch.compile` made anything in this process (a backend other than None)."""
    backends = eval_frame.cached_backends
    if len(backends) != _Eager.seen:
        _Eager.compiled = any(backend is not None for backend in list(backends.values()))
        _Eager.seen = len(backends)
    return _Eager.compiled


def force_eager():
    """Make compiled callables run eagerly until `restore(token)`; the token (None: no change)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return None
    if len(eval_frame.cached_backends) == _Eager.seen and not _Eager.compiled:
        return None  # nothing new since the last look, and nothing compiled: no call below
    if not _dynamo_has_compiled(eval_frame):
        return None
    import torch

    with _LOCK:
        if _Eager.depth == 0:
            try:
                stance = torch.compiler.set_stance("force_eager")  # torch >= 2.6
                stance.__enter__()
            except (AttributeError, RuntimeError):  # older torch; or inside a compiled region
                return None
            _Eager.prior = stance
        _Eager.depth += 1
    return _Eager


def quiet_backends():
    """The dict whose size alone says that `force_eager` has nothing new to do: dynamo's
    cached backends while nothing was compiled in this process (`force_eager` returned None
    for them), else None (ask `force_eager`). The compiled express run keeps it and asks
    `force_eager` again only once its size changed (as `force_eager` itself looks first)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or _Eager.compiled:
        return None
    backends = eval_frame.cached_backends
    return backends if len(backends) == _Eager.seen else None


def restore(token) -> None:
    """End what `force_eager` started; the last trace to end puts the prior stance back."""
    if token is None:
        return
    with _LOCK:
        _Eager.depth -= 1
        if _Eager.depth == 0:
            stance, _Eager.prior = _Eager.prior, None
            stance.__exit__(None, None, None)
