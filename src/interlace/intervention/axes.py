"""Which dimension of each value carries the batch: learned in a model's first batched run.

Sizes alone cannot tell. A position embedding of `arange(S)` has shape `(S, D)`, which looks
batched whenever `S` equals the batch; a loss has no batch dimension, like a value the whole
batch shares, but it is computed from every item. So a model's first batched run (invokes,
a sweep's batch) runs under a torch function mode that follows which tensors are computed
from the run's inputs, with a recording hook on every module: for every location it keeps,
per tensor leaf, `(shape, computed from the inputs, the batch total, batch axis)`. The run is the user's
own run (no extra forward pass); later runs read the signatures and pay nothing.
`batching.axis_of` turns a signature and a value into its batch axis:

- computed from the inputs: the axis whose size is the batch total (the inputs' batch dim
  first); none: the value is reduced over the batch (a loss, a `.mean()`);
- not computed from the inputs: shared by the whole batch (served whole; an item that edits
  it gets its own copy, `batching.expand`, which gives it a batch axis).

A location no signature covers (an operation inside a forward, `source.py`) is narrowed by the
size rule: its `batch_dim` is the batch axis when its size is the batch total.
"""

from __future__ import annotations

import threading
from functools import partial

import torch
from torch.overrides import TorchFunctionMode

from .batching import map_leaves


_TRANSPOSES = {"transpose", "swapaxes", "swapdims", "transpose_", "swapaxes_", "swapdims_"}


class _FromInputs(TorchFunctionMode):
    """Follows which tensors an operation computes from the inputs, and along which axis
    they carry the batch: `marked` maps id -> (tensor, axis or None), the tensor kept alive
    while the run is followed so that ids stay unique.

    The axis moves with transposes, permutes, (un)squeezes; any other operation keeps it
    when its output still has the batch's size there (the same rank), else takes the first
    axis of that size. That settles what sizes alone cannot: a GRU's `(seq, batch, ...)`
    output after a transpose, when the sequence is as long as the batch.
    """

    def __init__(self, marked):
        super().__init__()
        self.marked = marked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        source = self.source(args)
        if source is None and kwargs:
            source = self.source(kwargs)
        if source is not None:
            if out is None and args and isinstance(args[0], torch.Tensor):  # __setitem__
                out = args[0]
            self.mark(out, self.moved(func, args, kwargs, source), source)
        return out

    def source(self, value):
        """(tensor, axis) of the first marked tensor in `value`, or None."""
        if isinstance(value, torch.Tensor):
            return self.marked.get(id(value))
        if isinstance(value, (list, tuple)):
            for v in value:
                found = self.source(v)
                if found is not None:
                    return found
        elif isinstance(value, dict):
            return self.source(list(value.values()))
        return None

    @staticmethod
    def moved(func, args, kwargs, source):
        """Where `func` puts the source's batch axis (None: unknown, decide by size)."""
        tensor, axis = source
        if axis is None or not args or args[0] is not tensor:
            return axis
        name = getattr(func, "__name__", "")
        rank = tensor.dim()
        try:
            if name in _TRANSPOSES:
                d0, d1 = (args[1], args[2]) if len(args) > 2 else (kwargs.get("dim0"), kwargs.get("dim1"))
                d0, d1 = d0 % rank, d1 % rank
                return d1 if axis == d0 else d0 if axis == d1 else axis
            if name in ("t", "t_") and rank == 2:
                return 1 - axis
            if name == "permute":
                dims = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
                dims = [d % rank for d in (dims or kwargs.get("dims"))]
                return dims.index(axis)
            if name in ("unsqueeze", "unsqueeze_"):
                d = (args[1] if len(args) > 1 else kwargs["dim"]) % (rank + 1)
                return axis + 1 if d <= axis else axis
        except Exception:  # noqa: BLE001 - an unusual call: decide by size
            return None
        return axis

    def mark(self, value, axis=None, source=None):
        if isinstance(value, torch.Tensor):
            self.marked[id(value)] = (value, self.fit(value, axis, source))
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.mark(v, axis, source)
        elif isinstance(value, dict):
            for v in value.values():
                self.mark(v, axis, source)

    @staticmethod
    def fit(tensor, axis, source):
        """`axis` if `tensor` has the batch's size there, else its first axis of that size."""
        if source is None:
            return axis if axis is not None and tensor.dim() > axis else None
        origin, origin_axis = source
        if origin_axis is None:
            return None
        total = origin.shape[origin_axis]
        shape = tensor.shape
        if axis is not None and len(shape) > axis and shape[axis] == total:
            return axis
        for a, size in enumerate(shape):
            if size == total:
                return a
        return None


class Learner:
    """Follows one batched run: `signatures` fills as locations happen (read them live).

    `start(args, kwargs)` marks the inputs, hooks every module and enters the mode; `stop()`
    undoes both (in the same thread, at the run's teardown).
    """

    def __init__(self, state, total, dim):
        self.state = state
        self.total = total
        self.dim = dim  # the inputs' batch dim
        self.signatures = {}
        self.marked = {}
        self.mode = _FromInputs(self.marked)
        self.handles = []
        self.thread = threading.get_ident()
        self.active = False

    def record(self, key, value):
        """The signature of `key`'s value, at its first occurrence (before bodies edit it)."""
        if key in self.signatures or threading.get_ident() != self.thread:
            return
        marked, total, leaves = self.marked, self.total, []

        def sign(i, t):
            found = marked.get(id(t))
            leaves.append((tuple(t.shape), found is not None, total,
                           None if found is None else found[1]))
            return t

        map_leaves(value, sign)
        self.signatures[key] = leaves

    def _pre(self, key, module, args, kwargs):
        self.record(key, (args, kwargs))

    def _post(self, key, module, args, output):
        self.record(key, output)

    def start(self, args, kwargs):
        self.mode.mark(list(args), self.dim)
        self.mode.mark(kwargs, self.dim)
        for i, module in enumerate(self.state.modules):
            self.handles.append(module.register_forward_pre_hook(partial(self._pre, 2 * i),
                                                                 with_kwargs=True))
            self.handles.append(module.register_forward_hook(partial(self._post, 2 * i + 1)))
        self.mode.__enter__()
        self.active = True

    def stop(self):
        if self.active:
            self.active = False
            self.mode.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.marked.clear()
