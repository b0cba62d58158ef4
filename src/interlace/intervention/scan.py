"""`model.scan(x)`: run a trace on fake tensors, to check an intervention's shapes for free.

    with model.scan("The Eiffel Tower is in") as tracer:
        h = model.transformer.h[0].output.save()
        model.transformer.h[1].mlp.output[:, -1] = h[:, -1]   # a shape error raises here
    h.shape, h.dtype                                          # what the real trace would give

The body and the model run exactly as in `model.trace` (same inputs, batching, invokes, hooks)
but under torch's `FakeTensorMode`: every tensor carries a shape, dtype and device and no data,
so no kernel computes anything and no weight is read (a model whose weights are on the
`meta` device scans too). A shape or dtype mistake in the body raises the same exception
the real trace would, pointing at the user's line, in milliseconds.

Footguns of nnsight's scan fixed here, same call shape:
- saved tensors come back as `meta` tensors (shape, dtype, no data; `.device` is `meta`), not
  as fake tensors that outlive their mode: those keep answering `.sum()`, `.cpu()` with more
  fake tensors and only fail far away, at the first `float()` or mix with a real tensor. A
  meta tensor says "no data" at once. Tensors inside saved lists, tuples, dicts, model outputs
  and caches are converted too (lists and dicts in place, so `[].save()` lists stay the same);
- an error raised while scanning carries a note saying it was raised on fake tensors, at which
  line, and - for code that needs a tensor's *value* (`bool()`, `.item()`, a mask's
  nonzero count), which a scan cannot know - what to do instead; torch's own error log of
  the failed fake kernel is not printed.
"""

from __future__ import annotations

import logging
import threading

import torch

from .cache import Cache
from .tracer import _INTERLEAVING, InterleavingTracer



class ScanTracer(InterleavingTracer):
    """The tracer of `model.scan(...)`: `model.trace(...)` under fake tensors."""

    def __init__(self, model, args=(), kwargs=None, run=None, batcher=None):
        super().__init__(model, args, kwargs, run=run, batcher=batcher)
        self.backend = _SCAN

    @classmethod
    def of(cls, tracer):
        """The scan of what `tracer` (a `model.trace(...)` tracer, not entered) would run."""
        return cls(tracer.model, tracer.args, tracer.kwargs, run=tracer._run,
                   batcher=tracer._batcher)

    def push_result(self, values):
        """Saved fake tensors leave as meta tensors (see the module docstring)."""
        state = self.trace_state()
        saved = state.saved
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            for name, value in list(values.items()):
                if state.depth or id(value) in saved:
                    converted = to_meta(value)
                    if converted is not value:
                        saved[id(converted)] = converted
                        values[name] = converted
        super().push_result(values)


class _ScanBackend:
    """Runs the interleaving backend inside a `FakeTensorMode`."""

    def __call__(self, tracer):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        module = tracer.engine.module
        if _on_meta(module):
            tracer._run = _OnMeta(tracer._run or module)
        mode = _scan_mode(module)
        _QUIET.add()
        try:
            with mode:
                _INTERLEAVING(tracer)
        except Exception as error:
            _explain(error, tracer)
            raise
        finally:
            _QUIET.remove()
        with unset_fake_temporarily():
            tracer._result = to_meta(tracer._result)


_SCAN = _ScanBackend()


def _scan_mode(module):
    """A FakeTensorMode in which the model's own weights and buffers are always fake.

    Plain `FakeTensorMode(allow_non_fake_inputs=True)` runs an operation for real when none
    of its tensors is fake and it is one that takes numbers for tensors (`mul_`, `add`, ...):
    `weight.mul_(0)` in a scanned body would change the real weight. Here every tensor that
    shares storage with a parameter or buffer (`weight`, `weight.data`, a view of it) is
    replaced by its fake twin before torch looks at it, so a scan never reads or writes the
    model's memory; the other real tensors (the user's own, tokenized inputs) are handled as
    torch does (small constants are kept, so code reading them still works).
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._pytree import tree_map_only

    state = set()
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr:
                state.add(ptr)

    class ScanMode(FakeTensorMode):
        def dispatch(self, func, types, args=(), kwargs=None):
            convert = self.fake_tensor_converter.from_real_tensor

            def fake(t):
                if (not isinstance(t, FakeTensor) and t.device.type != "meta"
                        and t.untyped_storage().data_ptr() in state):
                    return convert(self, t)
                return t

            if state:
                args = tree_map_only(torch.Tensor, fake, args)
                kwargs = tree_map_only(torch.Tensor, fake, kwargs or {})
            return super().dispatch(func, types, args, kwargs)

    return ScanMode(allow_non_fake_inputs=True)


class _OnMeta:
    """The run of a model whose weights are on the meta device: inputs go there too."""

    __slots__ = ("run",)

    def __init__(self, run):
        self.run = run

    def __call__(self, *args, **kwargs):
        to = _to_device("meta")
        return self.run(*_apply(args, to), **_apply(kwargs, to))


def _on_meta(module):
    for p in module.parameters():
        return p.device.type == "meta"
    for b in module.buffers():
        return b.device.type == "meta"
    return False


def _to_device(device):
    return lambda t: t.to(device)


def _apply(value, fn):
    """`value` with `fn` applied to each tensor in it; lists and dicts changed in place."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Cache):
        value._map_tensors(fn)
        return value
    if isinstance(value, list):
        for i, item in enumerate(value):
            value[i] = _apply(item, fn)
        return value
    if isinstance(value, tuple):
        items = [_apply(v, fn) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        for key, item in list(value.items()):
            new = _apply(item, fn)
            if new is not item:
                value[key] = new
        return value
    return value


def _meta(t):
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(t, FakeTensor):
        return t
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def to_meta(value):
    """`value` with every fake tensor in it replaced by a meta tensor of its shape and dtype."""
    return _apply(value, _meta)


# -- errors ----------------------------------------------------------------------------------


def _explain(error, tracer):
    if not hasattr(error, "add_note"):  # Python 3.10: the error alone
        return
    where = _user_line(error, tracer)
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    note = (
        f"interlace: raised while scanning (model.scan runs the trace on fake tensors: "
        f"shapes and dtypes only, no data){f' at {where}' if where else ''}"
    )
    if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
        note += (
            ". This code needs a tensor's values (bool(), .item(), float(), a boolean mask's "
            "size), which a scan does not have: keep it out of the scanned block, or guard it "
            "with `if not isinstance(x, torch._subclasses.FakeTensor)`, and run model.trace "
            "for real values"
        )
    error.add_note(note)


def _user_line(error, tracer):
    """file:line of the innermost traceback frame in the file of the scanned block."""
    filename = tracer.block.filename
    found = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            found = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


class _QuietFakeLog(logging.Filter):
    """Drops torch's "failed while attempting to run meta" log records of scanning threads:
    the error itself reaches the user, with a note; the log would print it a second time."""

    def __init__(self):
        super().__init__()
        self.threads = {}
        self.lock = threading.Lock()
        self.logger = logging.getLogger("torch._subclasses.fake_tensor")

    def filter(self, record):
        return record.thread not in self.threads

    def add(self):
        me = threading.get_ident()
        with self.lock:
            self.threads[me] = self.threads.get(me, 0) + 1
            if len(self.threads) == 1 and self.threads[me] == 1:
                self.logger.addFilter(self)

    def remove(self):
        me = threading.get_ident()
        with self.lock:
            left = self.threads[me] - 1
            if left:
                self.threads[me] = left
            else:
                del self.threads[me]
            if not self.threads:
                self.logger.removeFilter(self)


_QUIET = _QuietFakeLog()
