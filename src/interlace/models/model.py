"""`Model`: wrap any `torch.nn.Module` so that `with model.trace(...)` can read and edit it.

Wrapping installs nothing: outside a trace, `model(x)` is the module's own call, with no
hooks and its own `forward` (a wrapper on every module would cost every forward, traced or
not). A wrapper composes one `Engine` (intervention/engine.py), which runs every trace;
subclasses give it their batching strategy (LanguageModel: tokenize and left-pad) and give
their tracers what one run calls (a forward with keywords, a generation).
"""

from __future__ import annotations

import warnings

import torch

from ..errors import InterlaceError
from ..intervention import edit as _edit
from ..intervention import aliases
from ..intervention.access import engine_of, module_of
from ..intervention.batching import Batcher
from ..intervention.engine import Engine
from ..intervention.envoy import COLLISION_PREFIX, ROOT_CLASS, SERVED, Envoy, served_collisions
from ..intervention.session import Session, check_remote
from ..intervention.tracer import InterleavingTracer, compiled_trace
from .export import AS_GIVEN, export, noop


class Model(Envoy):
    """A traceable model: `Model(module)` (alias `NNsight`), then `with model.trace(x):`."""

    def __init__(self, module: torch.nn.Module, *, rename=None, envoys=None, batch_dim=None,
                 _batcher=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"Model wraps a torch.nn.Module, got {type(module).__name__}; for a "
                f"transformers repo id use interlace.LanguageModel"
            )
        if envoys is not None and not (isinstance(envoys, (type, dict))):
            raise TypeError(
                f"envoys= takes an Envoy subclass or a dict {{module class or path suffix: "
                f"Envoy subclass}}, got {type(envoys).__name__}"
            )
        if batch_dim is not None and (isinstance(batch_dim, bool) or not isinstance(batch_dim, int)
                                      or batch_dim < 0):
            raise ValueError(
                f"batch_dim= is the dimension of the model's inputs that invokes and sweep items "
                f"are concatenated along: a non-negative int (0 for batch-first inputs, 1 for "
                f"(sequence, batch, ...)), got {batch_dim!r}"
            )
        if _batcher is None and batch_dim is not None:
            _batcher = Batcher(batch_dim)
        engine = Engine(module, batcher=_batcher, aliases=aliases.plan(module, rename, SERVED),
                        envoy_classes=envoys, batch_dim=batch_dim)
        object.__setattr__(self, "_options", {"rename": rename, "envoys": envoys,
                                              "batch_dim": batch_dim})
        super().__init__(module, "model", _engine=engine)
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

    def trace(self, *args, remote=False, trace=True, tracer_cls=None, **kwargs):
        """`with model.trace(*inputs) as tracer:` - the body runs interleaved with the forward.

        With no inputs, put each input in a `with tracer.invoke(*inputs):` block inside the
        body; the invokes run batched in one forward pass. `trace=False` runs the model on
        the inputs now, with no block, and returns its output (recorded edits apply);
        `tracer_cls=` makes another `InterleavingTracer` subclass, built as this one is.
        """
        if remote is not False:
            check_remote(remote, "model.trace")
        cls = InterleavingTracer if tracer_cls is None else tracer_class(
            tracer_cls, InterleavingTracer, "model.trace")
        tracer = cls(self, args, kwargs)
        return tracer if trace else tracer.run_untraced()

    def wrapper_recipe(self):
        """How to make this wrapper again elsewhere (a Ray worker): `(cls, args, kwargs,
        loaded)`, where `cls(*args, **kwargs)` rebuilds it; `loaded` says that `args` name
        where the weights load from (a repo id or folder) instead of holding the module."""
        return type(self), (module_of(self),), dict(self.wrapper_options()), False

    def wrapper_options(self) -> dict:
        """The keywords this wrapper was made with beyond the module (`rename=`, `envoys=`):
        what a copy made elsewhere (a Ray worker) needs to look the same."""
        options = self.__dict__.get("_options", {})
        return {name: value for name, value in options.items() if value is not None}

    def scan(self, *args, **kwargs):
        """`with model.scan(*inputs) as tracer:` - `trace` on fake tensors: no compute, no weights
        read; shape errors raise at the body's line and saved tensors come back as meta tensors
        (shape and dtype only). Takes what `trace` takes. See docs/scan.md."""
        from ..intervention.scan import ScanTracer

        return ScanTracer.of(self.trace(*args, **kwargs))

    def sweep(self, items, input=None, *, batch_size=None, progress=True, executor="local",
              workers=None, generate=False, save_to=None, overwrite=False, **kwargs):
        """`with model.sweep(items, input=x) as sweep:` - the body runs once per item, batched.

        Inside the body `sweep.item` is the current item and `sweep.output` its part of the
        model's return value; after the block each saved name is a list of its values in
        item order (`sweep.results` maps name -> list). `input=None`: each item is the
        input; a callable: `input(item)`; anything else: one input shared by every item.
        Other keywords go to the forward. `save_to=path` writes the saved values to a
        `datasets` folder batch by batch and resumes there after a crash (`overwrite=True`
        starts over). See docs/sweeps.md and docs/datasets.md.
        """
        from ..sweeps import SweepTracer

        if generate:
            raise InterlaceError(
                "generate=True runs transformers generation; wrap the model with "
                "interlace.LanguageModel to sweep generations"
            )
        return SweepTracer(self, items, input, batch_size=batch_size, progress=progress,
                           executor=executor, workers=workers, save_to=save_to,
                           overwrite=overwrite, kwargs=kwargs)

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
        """Drop every edit recorded on this wrapper (copies made from it keep theirs), and so
        from what the modules `as_module()` returned for it run."""
        _edit.set_edits(self, ())

    def as_module(self) -> torch.nn.Module:
        """A `torch.nn.Module` of the original class, sharing its weights, whose every call
        (`generate` too: one run, a step per forward) runs this wrapper's edits: for code that
        takes a model and calls it itself (pipelines, evaluation harnesses). See docs/edit.md."""
        return export(self)

    def rewrap(self, module):
        """A wrapper of `module` made as this one was (`rename=`, `envoys=`, ...), with no edit."""
        return type(self)(module, **self.wrapper_options())

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
        edits = _edit.replays(self)
        if edits:
            engine = engine_of(self)
            if engine.active() is None:
                # an edited wrapper called directly runs its edits too (nnsight runs it
                # unedited): one call of the module on the inputs as given
                return engine.interleave([(noop, args, kwargs)], batcher=AS_GIVEN, edits=edits)
        return Envoy.__call__(self, *args, **kwargs)


def tracer_class(given, default, what):
    """The tracer class `what(tracer_cls=given)` builds: `default`, or `given`, a subclass of
    `InterleavingTracer` made with the arguments `default` is made with."""
    if given is None:
        return default
    if not (isinstance(given, type) and issubclass(given, InterleavingTracer)):
        raise TypeError(
            f"{what}(tracer_cls={given!r}): tracer_cls= takes a subclass of "
            f"interlace.intervention.tracer.InterleavingTracer (made as {default.__name__} is)"
        )
    return given


Model.trace = compiled_trace(Model.trace)
ROOT_CLASS[:] = [Model]  # `Envoy(module)` is a traceable root, as in nnsight 0.8
