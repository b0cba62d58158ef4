"""`Model`: wrap any `torch.nn.Module` so that `with model.trace(...)` can read and edit it.

Wrapping installs nothing: outside a trace, `model(x)` is the module's own call, with no
hooks and its own `forward` (a wrapper on every module would cost every forward, traced or
not). Subclasses (LanguageModel) change how inputs are batched (`_batcher`) and what one
run calls (`_run_model`).
"""

from __future__ import annotations

import warnings

import torch

from ..errors import InterlaceError
from ..intervention import edit as _edit
from ..intervention.batching import Batcher
from ..intervention import aliases
from ..intervention.envoy import SERVED, COLLISION_PREFIX, ROOT_CLASS, Envoy, served_collisions
from ..intervention.interleaver import Interleaver, ModelState
from ..intervention.session import Session, check_remote
from ..intervention.tracer import InterleavingTracer


class Model(Envoy):
    """A traceable model: `Model(module)` (alias `NNsight`), then `with model.trace(x):`."""

    _edits = ()  # recorded `model.edit()` blocks, replayed by every run (see intervention/edit.py)

    def __init__(self, module: torch.nn.Module, *, rename=None, envoys=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"Model wraps a torch.nn.Module, got {type(module).__name__}; for a "
                f"transformers repo id use interlace.LanguageModel"
            )
        state = ModelState(module)
        state.aliases = aliases.plan(module, rename, SERVED)
        if envoys is not None and not (isinstance(envoys, (type, dict))):
            raise TypeError(
                f"envoys= takes an Envoy subclass or a dict {{module class or path suffix: "
                f"Envoy subclass}}, got {type(envoys).__name__}"
            )
        state.envoy_classes = envoys
        object.__setattr__(self, "_options", {"rename": rename, "envoys": envoys})
        super().__init__(module, "model", _state=state)
        collisions = served_collisions(module)
        if collisions:
            shown = ", ".join(collisions[:3]) + (f" and {len(collisions) - 3} more" if len(collisions) > 3 else "")
            warnings.warn(
                f"{shown}: a submodule named after a value interlace serves on every module; "
                f"`.{collisions[0].rsplit('.', 1)[-1]}` stays that value, and the submodule is "
                f"`.{COLLISION_PREFIX}{collisions[0].rsplit('.', 1)[-1]}` (or "
                f"`[{collisions[0].rsplit('.', 1)[-1]!r}]`)",
                UserWarning, stacklevel=2,
            )

    # -- tracing ---------------------------------------------------------------------------

    def trace(self, *args, remote=False, **kwargs):
        """`with model.trace(*inputs) as tracer:` - the body runs interleaved with the forward.

        With no inputs, put each input in a `with tracer.invoke(*inputs):` block inside the
        body; the invokes run batched in one forward pass.
        """
        check_remote(remote, "model.trace")
        return InterleavingTracer(self, args, kwargs)

    def wrapper_options(self) -> dict:
        """The keywords this wrapper was made with beyond the module (`rename=`, `envoys=`):
        what a copy made elsewhere (a Ray worker) needs to look the same."""
        options = self.__dict__.get("_options", {})
        return {name: value for name, value in options.items() if value is not None}

    def _trace_with(self, run, args, kwargs):
        """A trace whose run calls `run(*batched inputs)` instead of the module (`@traceable`)."""
        return InterleavingTracer(self, args, kwargs, run=run)

    def scan(self, *args, **kwargs):
        """`with model.scan(*inputs) as tracer:` - `trace` on fake tensors: no compute, no weights
        read; shape errors raise at the body's line and saved tensors come back as meta tensors
        (shape and dtype only). Takes what `trace` takes. See docs/scan.md."""
        from ..intervention.scan import ScanTracer

        return ScanTracer.of(self.trace(*args, **kwargs))

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

    def edit(self, *, inplace=False, backend=None):
        """`with model.edit() as edited:` - record interventions every later run of `edited` makes.

        The body does not run now: it runs at the start of every later trace (each invoke,
        each generation, each sweep item, a direct call `edited(x)`) of the returned copy,
        before the trace's own body. `model` stays clean; `inplace=True` edits `model`
        itself (`with model.edit(inplace=True) as tracer:`). The tuple form
        `as (tracer, edited)` also binds the tracer (for `tracer.iter` / `tracer.all()` in
        the body). `clear_edits()` drops them. See docs/edit.md.
        """
        if backend is not None:
            raise InterlaceError(
                f"model.edit(backend={backend!r}): edits are recorded, not run, so they take no "
                f"backend; pass one to the traces that replay them"
            )
        return _edit.EditTracer(self if inplace else _edit.copy_wrapper(self), inplace)

    def clear_edits(self):
        """Drop every edit recorded on this wrapper (copies made from it keep theirs)."""
        object.__setattr__(self, "_edits", ())

    def session(self, backend=None, remote=False, tracer_cls=None):
        """`with model.session() as session:` - several traces in one block, sharing values.

        A value a trace in the session assigns is usable in the session's later traces and
        lines without `.save()`; when the session ends, only saved values come back. See
        docs/session.md.
        """
        check_remote(remote, "model.session")
        if tracer_cls is not None:
            return tracer_cls(backend=backend)
        return Session(self, backend=backend)

    def __call__(self, *args, **kwargs):
        if self._edits and self._active() is None:
            # an edited wrapper called directly runs its edits too (nnsight runs it unedited)
            return self._interleave([(_noop, args, kwargs)], direct=True)
        return Envoy.__call__(self, *args, **kwargs)

    # -- what subclasses change ------------------------------------------------------------------

    def _batcher(self) -> Batcher:
        """How invokes' inputs become one batch (LanguageModel: tokenize and left-pad)."""
        return Batcher()

    def _run_model(self, *args, **kwargs):
        """One run of the model on the batched inputs (LanguageModel.generate overrides)."""
        return self._module(*args, **kwargs)

    def _interleave(self, invokes, run=None, backward=False, direct=False):
        """Run the model once with one mediator per `(fn, args, kwargs)` in `invokes`.

        Each `fn` is a body (normally a captured `with` block's `run_body`); with several
        invokes their inputs are batched and each body sees only its own rows. `run` replaces
        `_run_model` (generation); `backward=True` lets bodies use `with loss.backward():`.
        Returns the model's return value. The wrapper's edits run first, once per invoke
        (on its rows). `direct=True`: one call of the module on the inputs as given.
        """
        interleaver = Interleaver(self._state, backward)
        # one plain call of the module: the engine hands the root's input/output over itself
        root_call = run is None and type(self)._run_model is Model._run_model
        if direct or len(invokes) == 1 and type(self)._batcher is Model._batcher:
            # one input as given: nothing to batch (subclasses still prepare theirs)
            fn, args, kwargs = invokes[0]
            if self._edits:
                _edit.add_edits(interleaver, self, [None])
            interleaver.add(fn)
            if direct:
                return interleaver.run(self._module, args, kwargs, True)
            return interleaver.run(run or self._run_model, args, kwargs, root_call)
        batcher = self._batcher()
        prepared = [batcher.prepare(args, kwargs) for _, args, kwargs in invokes]
        args, kwargs = batcher.batch(prepared) if prepared else ((), {})
        if len(invokes) > 1:
            rows = batcher.slices(prepared)
            interleaver.total = rows[-1].stop
            if self._edits:
                _edit.add_edits(interleaver, self, rows)
            for i, ((fn, _, _), part) in enumerate(zip(invokes, rows)):
                interleaver.add(fn, part, label=f"invoke {i}")
        else:
            if self._edits and invokes:
                _edit.add_edits(interleaver, self, [None])
            for fn, _, _ in invokes:
                interleaver.add(fn)
        return interleaver.run(run or self._run_model, args, kwargs, root_call)


def _noop():
    """The body of a direct call of an edited wrapper: only its edits act."""


ROOT_CLASS[:] = [Model]  # `Envoy(module)` is a traceable root, as in nnsight 0.8
