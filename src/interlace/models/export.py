"""`edited.as_module()`: the edited model as a plain `torch.nn.Module` that any code can call.

Tools that take a model object and call it themselves (`generate`, `transformers` pipelines,
lm-evaluation-harness, a hand-written loop) never see a wrapper's edits. `as_module()` gives
them a module of the original class (a subclass made once per class, with the same name, so
`isinstance`, `save_pretrained`'s `architectures` and pipelines' checks see the original)
that is a second view of the same module: its `__dict__` is a shallow copy of the
original's, so its parameters, buffers, submodules and hooks are the original's own objects
(no copy; `.to()` moves the shared weights, `state_dict`/`save_pretrained` write them with no
edit). Only calling it differs:

- a call with no run going is a run of one step of the wrapper's recorded edits (as
  `edited(x)`), on the inputs exactly as given (any batch size, any padding);
- `generate(...)` is one run with a step per forward, as `edited.generate`: an edit looping
  over `tracer.all()` holds at every step;
- a call inside a running trace of the same model (its body, or an edit) is refused.

The module holds the wrapper, never a copy of its edits: `clear_edits()` (or another
`edit(inplace=True)`) on the wrapper changes what the module runs from its next call. The
wrapper does not hold the module, so there is no reference cycle.
"""

from __future__ import annotations

import copy
import operator
import threading

import torch

from ..errors import InterlaceError
from ..intervention import edit as _edit
from ..intervention.access import engine_of, module_of
from ..intervention.batching import Batcher

AS_GIVEN = Batcher()  # one call's inputs, as given (Batcher.as_given)


def noop():
    """The body of a direct call of an edited wrapper or exported module: only its edits act."""


_STATE = "_interlace_export"  # the key of the module's `Export` in its __dict__
_CLASSES = {}  # original class -> its exported subclass
_CLASSES_LOCK = threading.Lock()


class Export:
    """What an exported module knows beyond the original's `__dict__`: the wrapper whose
    edits it runs, the original module it calls, and which thread is generating with it."""

    __slots__ = ("wrapper", "original", "generating")

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.original = module_of(wrapper)
        self.generating = None  # thread ident of a running `generate` of the module

    def call(self, args, kwargs, run=None):
        """One run of the original module (or of `run`) with the wrapper's edits replayed."""
        wrapper = self.wrapper
        engine = engine_of(wrapper)
        active = engine.active()
        if active is not None:
            if run is None and self.generating == threading.get_ident():
                return self.original(*args, **kwargs)  # one step of our own generate
            raise InterlaceError(
                f"the module from as_module() of this {type(self.original).__name__} was called "
                f"while a trace of the same model is running in this thread (inside its body or "
                f"an edit): its edits need a run of their own. Call it after the trace block, "
                f"or use the wrapper's Envoys inside the trace"
            )
        edits = _edit.replays(wrapper)
        call = self.original if run is None else run
        if not edits:
            return call(*args, **kwargs)  # no edit: the original, as it is
        return engine.interleave([(noop, args, kwargs)], run=run, batcher=AS_GIVEN, edits=edits,
                                 rows=_rows(args, kwargs, run))


def _rows(args, kwargs, run):
    """The rows of a call's batch, each of which gets its own replay of the edits (as an
    invoke of one prompt would), or None (one replay over the whole batch): a generation
    that expands rows (beam search, several sequences per prompt) keeps one replay."""
    if run is not None and (int(kwargs.get("num_beams") or 1) > 1
                            or int(kwargs.get("num_return_sequences") or 1) > 1
                            or int(getattr(kwargs.get("generation_config"), "num_beams", 1) or 1) > 1):
        return None
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = args[0] if args else None
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return ids.shape[0]
    return None


class Exported:
    """Mixed in before the original class: calls run the edits (see the module docstring)."""

    def __call__(self, *args, **kwargs):
        return self.__dict__[_STATE].call(args, kwargs)

    def __deepcopy__(self, memo):
        """A copy with its own weights (a deep copy of the original) and the same edits."""
        state = self.__dict__[_STATE]
        module = copy.deepcopy(state.original, memo)
        wrapper = _edit.set_edits(state.wrapper.rewrap(module), _edit.edits_of(state.wrapper))
        exported = export(wrapper)
        exported.__dict__["training"] = self.training
        return exported

    def __reduce_ex__(self, protocol):
        """Pickles (`torch.save`) as the original module: its class and weights, no edit."""
        return operator.itemgetter(0), ((self.__dict__[_STATE].original,),)


class ExportedGenerate(Exported):
    """For a class with `generate`: one run with a step per forward."""

    def generate(self, *args, **kwargs):
        state = self.__dict__[_STATE]
        cls = type(state.original)
        me = threading.get_ident()
        if state.generating == me:  # re-entered (a step calling generate): no run of its own
            return cls.generate(self, *args, **kwargs)

        def run(*args, **kwargs):
            state.generating = me
            try:
                return cls.generate(self, *args, **kwargs)
            finally:
                state.generating = None

        run.generates = True
        return state.call(args, kwargs, run=run)


def export(wrapper):
    """The module `wrapper.as_module()` returns (see the module docstring)."""
    original = module_of(wrapper)
    module = object.__new__(_class_of(type(original)))
    module.__dict__.update(original.__dict__)
    module.__dict__[_STATE] = Export(wrapper)
    return module


def _class_of(cls):
    """The exported subclass of `cls`, made once: same name, module and qualified name."""
    with _CLASSES_LOCK:
        exported = _CLASSES.get(cls)
        if exported is None:
            mixin = ExportedGenerate if callable(getattr(cls, "generate", None)) else Exported
            exported = type(cls.__name__, (mixin, cls), {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
            })
            _CLASSES[cls] = exported
        return exported
