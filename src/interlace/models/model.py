"""`Model`: wrap any `torch.nn.Module` so that `with model.trace(...)` can read and edit it.

Wrapping installs nothing: outside a trace, `model(x)` is the module's own call, with no
hooks and its own `forward` (a wrapper on every module would cost every forward, traced or
not). Subclasses (LanguageModel) change how inputs are batched (`_batcher`) and what one
run calls (`_run_model`).
"""

from __future__ import annotations

import threading

import torch

from ..errors import InterlaceError
from ..intervention.batching import Batcher
from ..intervention.envoy import Envoy
from ..intervention.interleaver import Interleaver, ModelState
from ..intervention.tracer import InterleavingTracer


class Model(Envoy):
    """A traceable model: `Model(module)` (alias `NNsight`), then `with model.trace(x):`."""

    def __init__(self, module: torch.nn.Module):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"Model wraps a torch.nn.Module, got {type(module).__name__}; for a "
                f"transformers repo id use interlace.LanguageModel"
            )
        super().__init__(module, "model")
        object.__setattr__(self, "_state", ModelState(module))

    def _state_for_tree(self):
        return self._state

    def _active(self):
        """The interleaver running a trace of this model in *this* thread, if any."""
        state = self._state
        if state.owner == threading.get_ident():
            return state.active
        return None

    # -- tracing ---------------------------------------------------------------------------

    def trace(self, *args, **kwargs):
        """`with model.trace(*inputs) as tracer:` - the body runs interleaved with the forward.

        With no inputs, put each input in a `with tracer.invoke(*inputs):` block inside the
        body; the invokes run batched in one forward pass.
        """
        return InterleavingTracer(self, args, kwargs)

    def sweep(self, items, input=None, *, batch_size=None, progress=True, executor="local",
              workers=None, generate=False, **kwargs):
        """`with model.sweep(items, input=x) as sweep:` - the body runs once per item, batched.

        Inside the body `sweep.item` is the current item and `sweep.output` its part of the
        model's return value; after the block each saved name is a list of its values in
        item order (`sweep.results` maps name -> list). `input=None`: each item is the
        input; a callable: `input(item)`; anything else: one input shared by every item.
        Other keywords go to the forward. See docs/sweeps.md.
        """
        from ..sweeps import SweepTracer

        if generate:
            raise InterlaceError(
                "generate=True runs transformers generation; wrap the model with "
                "interlace.LanguageModel to sweep generations"
            )
        return SweepTracer(self, items, input, batch_size=batch_size, progress=progress,
                           executor=executor, workers=workers, kwargs=kwargs)

    def __call__(self, *args, **kwargs):
        return Envoy.__call__(self, *args, **kwargs)

    # -- what subclasses change ------------------------------------------------------------------

    def _batcher(self) -> Batcher:
        """How invokes' inputs become one batch (LanguageModel: tokenize and left-pad)."""
        return Batcher()

    def _run_model(self, *args, **kwargs):
        """One run of the model on the batched inputs (LanguageModel.generate overrides)."""
        return self._module(*args, **kwargs)

    def _interleave(self, invokes, run=None, backward=False):
        """Run the model once with one mediator per `(fn, args, kwargs)` in `invokes`.

        Each `fn` is a body (normally a captured `with` block's `run_body`); with several
        invokes their inputs are batched and each body sees only its own rows. `run` replaces
        `_run_model` (generation); `backward=True` lets bodies use `with loss.backward():`.
        Returns the model's return value.
        """
        interleaver = Interleaver(self._state, backward)
        # one plain call of the module: the engine hands the root's input/output over itself
        root_call = run is None and type(self)._run_model is Model._run_model
        if len(invokes) == 1 and type(self)._batcher is Model._batcher:
            # one input as given: nothing to batch (subclasses still prepare theirs)
            fn, args, kwargs = invokes[0]
            interleaver.add(fn)
            return interleaver.run(run or self._run_model, args, kwargs, root_call)
        batcher = self._batcher()
        prepared = [batcher.prepare(args, kwargs) for _, args, kwargs in invokes]
        args, kwargs = batcher.batch(prepared) if prepared else ((), {})
        if len(invokes) > 1:
            rows = batcher.slices(prepared)
            interleaver.total = rows[-1].stop
            for i, ((fn, _, _), part) in enumerate(zip(invokes, rows)):
                interleaver.add(fn, part, label=f"invoke {i}")
        else:
            for fn, _, _ in invokes:
                interleaver.add(fn)
        return interleaver.run(run or self._run_model, args, kwargs, root_call)
