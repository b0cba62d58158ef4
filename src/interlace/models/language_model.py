"""`LanguageModel`: a `Model` over a `transformers` causal LM, with its tokenizer.

What it adds to `Model`: loading by repo id or folder, turning prompts (text, token ids,
tokenizer output) into one left-padded batch with `position_ids`, and `generate`.
"""

from __future__ import annotations

import torch

from ..intervention.access import engine_of, module_of
from ..intervention.session import check_remote
from ..intervention.tracer import InterleavingTracer, compiled_trace
from . import inputs as _inputs
from .fingerprint import fingerprint
from .inputs import POSITION_IDS, PromptBatcher
from .inputs import UnknownKeywordError  # noqa: F401 - raised by trace/generate: importable here
from .loading import automodel_for_task, load_model, load_tokenizer, resolve_dtype
from .model import Model, tracer_class


class LanguageModel(Model):
    """A causal language model you can trace, batch prompts into, and generate from.

    `LanguageModel("gpt2")` or `LanguageModel("/path/to/save_pretrained/folder")` loads with
    `AutoModelForCausalLM`/`AutoTokenizer`; `LanguageModel(module, tokenizer=tok)` wraps a
    model already in memory. `device_map=` (accelerate, incl. CPU/disk offload), `dtype=`
    (alias `torch_dtype=`), `automodel=` (another Auto class) and any other keyword go to
    `from_pretrained`. nnsight's keywords: `task=` picks the Auto class by task name
    ("text-generation", "text-classification", "seq2seq", ...); `dispatch=` is accepted for
    compatibility - interlace always loads the weights when the wrapper is made (nnsight's
    `dispatch=True`), never lazily on a meta device.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        device_map=None,
        dtype=None,
        *,
        torch_dtype=None,
        automodel=None,
        task=None,
        dispatch=None,
        rename=None,
        envoys=None,
        **kwargs,
    ):
        dtype = resolve_dtype(dtype, torch_dtype)
        if task is not None and automodel is not None:
            raise TypeError(
                "both task= and automodel= were given; task= only picks an Auto class, "
                "pass one of them"
            )
        if dispatch is not None and not isinstance(dispatch, bool):
            raise TypeError(f"dispatch= takes True or False, got {dispatch!r}")
        if isinstance(model, torch.nn.Module):
            extra = {"device_map": device_map, "automodel": automodel, **kwargs}
            given = sorted(k for k, v in extra.items() if v is not None)
            if given:
                raise TypeError(
                    f"{', '.join(given)} only apply when LanguageModel loads a model from a repo "
                    "id or folder; this one was given an nn.Module already in memory, so set it "
                    "up before wrapping it"
                )
            module = model if dtype is None else model.to(dtype)
            if isinstance(tokenizer, str):
                tokenizer = load_tokenizer(tokenizer)
        elif isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            name = str(model if not isinstance(model, bytes) else model.decode())
            if task is not None:
                automodel = automodel_for_task(task)
            module = load_model(
                name, automodel=automodel, device_map=device_map, dtype=dtype, **kwargs
            )
            if tokenizer is None or isinstance(tokenizer, str):
                tokenizer = load_tokenizer(tokenizer or name)
        else:
            raise TypeError(
                f"LanguageModel takes a repo id, a folder path or a torch.nn.Module, "
                f"got a value of type {type(model).__name__}"
            )
        super().__init__(module, rename=rename, envoys=envoys,
                         _batcher=PromptBatcher(module, tokenizer))
        object.__setattr__(self, "tokenizer", tokenizer)
        recipe = None
        if not isinstance(model, torch.nn.Module):  # how a Ray worker rebuilds this model
            recipe = (
                (name,),
                dict(tokenizer=tokenizer, device_map=device_map, dtype=dtype, automodel=automodel,
                     **self.wrapper_options(), **kwargs),  # (task= has become automodel= above)
                _unchanged_since_load(module),
            )
        object.__setattr__(self, "_load_recipe", recipe)

    # --- tracing and generation ------------------------------------------------------

    def trace(self, *args, remote=False, trace=True, tracer_cls=None, **kwargs):
        """`with model.trace(prompt, **forward_kwargs) as tracer:` - one forward pass.

        `prompt` is text, a list of texts, token ids or a tokenizer's output; several prompts
        are left-padded into one batch with matching `attention_mask` and `position_ids`.
        Without a prompt, give each one its own `with tracer.invoke(prompt):`. Other keywords
        (`output_hidden_states=True`, ...) go to the model's forward for the whole batch and
        are checked now: transformers' forward would silently ignore a misspelt one.
        `trace=False` runs the forward on the prompt now and returns its output (no block);
        `tracer_cls=` makes another `InterleavingTracer` subclass (as `Model.trace`).
        """
        if remote is not False:
            check_remote(remote, "model.trace")
        cls = InterleavingTracer if tracer_cls is None else tracer_class(
            tracer_cls, InterleavingTracer, "model.trace")
        run = None
        if kwargs:  # (a prompt alone, the usual call, has no keyword to split or check)
            kwargs, rest = _split_prompt(kwargs)
            if rest:
                self.check_forward_kwargs(rest)
                run = _Forward(module_of(self), rest)
        tracer = cls(self, args, kwargs, run=run)
        return tracer if trace else tracer.run_untraced()

    def generate(self, *args, remote=False, trace=True, tracer_cls=None, **kwargs):
        """`with model.generate(prompt, max_new_tokens=N, **generate_kwargs) as tracer:`.

        Runs `transformers` generation with the body interleaved. Each new token is one call
        of the model, one *step*: reads and edits bind to step 0 unless a
        `for step in tracer.iter[...]:` loop (or `tracer.all()`) pins them to other steps.
        `tracer.result` is what `generate` returns (the prompt ids followed by the new ones).
        Without a prompt (`model.generate(max_new_tokens=N)`), give each prompt its own
        `with tracer.invoke(prompt):`; the keywords here apply to the whole generation.
        `trace=False` generates now and returns what `generate` returns (no block);
        `tracer_cls=` as in `trace`.
        """
        check_remote(remote, "model.generate")
        cls = tracer_class(tracer_cls, InterleavingTracer, "model.generate")
        prompt, rest = _split_prompt(kwargs)
        module = module_of(self)
        config = getattr(module, "generation_config", None)
        if "pad_token_id" not in rest and getattr(config, "pad_token_id", None) is None:
            # The id we pad with; transformers would otherwise log a warning per generation.
            rest["pad_token_id"] = _inputs.pad_token_id(self.tokenizer)
        tracer = cls(self, args, prompt, run=_Generation(module, rest))
        return tracer if trace else tracer.run_untraced()

    def sweep(self, items, input=None, *, batch_size=None, progress=True, executor="local",
              workers=None, generate=False, save_to=None, overwrite=False, **kwargs):
        """`with model.sweep(items, input=prompt) as sweep:` - the body runs once per item.

        As `Model.sweep`; a batch only holds prompts of one length (no item is padded for
        another's sake), and an item holding several prompts is left-padded as `trace` pads.
        Keywords go to the forward (checked as `trace` checks them), or to `generate` with
        `generate=True`, where `sweep.output` is the item's generated ids and
        `sweep.iter[...]` its steps.
        """
        from ..sweeps import SweepTracer

        if "input_ids" in kwargs or "attention_mask" in kwargs or "position_ids" in kwargs:
            raise TypeError(
                "model.sweep(...) takes prompts through input= (shared) or the items "
                "themselves (input=None), not as input_ids=/attention_mask=/position_ids="
            )
        eos = ()
        module = module_of(self)
        if generate:
            config = getattr(module, "generation_config", None)
            if "pad_token_id" not in kwargs and getattr(config, "pad_token_id", None) is None:
                kwargs["pad_token_id"] = _inputs.pad_token_id(self.tokenizer)
            eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
            eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
            run = _Generation(module, kwargs)
        else:
            self.check_forward_kwargs(kwargs)
            run = _Forward(module, kwargs) if kwargs else None
        return SweepTracer(self, items, input, batch_size=batch_size, progress=progress,
                           executor=executor, workers=workers, generate=generate, run=run,
                           eos=eos, save_to=save_to, overwrite=overwrite)

    def rewrap(self, module):
        """As `Model.rewrap`, with this wrapper's tokenizer."""
        return type(self)(module, tokenizer=self.tokenizer, **self.wrapper_options())

    # --- inputs: what the engine's batching (inputs.PromptBatcher) does ------------------

    def prepare_inputs(self, *args, **kwargs) -> tuple[dict, dict]:
        """One invoke's `(args, kwargs)` -> (`batch` of padded tensors, other model kwargs).

        The prompt is the single positional argument, or `input_ids=` (with optional
        `attention_mask=`) given as keywords. Other keywords are returned as they are (the
        batcher checks them against the model's forward when tracing).
        """
        return self._prompts().prepare_inputs(*args, **kwargs)

    def model_kwargs(self, batch: dict, kwargs: dict, *, positions=True) -> dict:
        """The module's keyword inputs: the batch on the input device, positions, the rest.

        `position_ids` come from the final mask. Generation passes `positions=False`:
        transformers' generate computes the very same positions from the mask itself (and
        extends them per step more cheaply than when they are given).
        """
        return self._prompts().model_kwargs(batch, kwargs, positions=positions)

    def check_forward_kwargs(self, kwargs):
        """Refuse keywords the model's forward would silently drop (generate checks its own)."""
        self._prompts().check_forward_kwargs(kwargs)

    @property
    def input_device(self) -> torch.device:
        """Where input ids must live: the embedding's device (accelerate may spread the rest)."""
        return self._prompts().input_device

    def _prompts(self) -> PromptBatcher:
        return engine_of(self).batcher

    def wrapper_recipe(self):
        """As `Model.wrapper_recipe`; a model loaded by repo id or folder, whose weights are
        still the ones loaded, is made again from that name (`loaded=True`)."""
        recipe = self.__dict__.get("_load_recipe")
        if recipe is not None and recipe[2]():
            args, kwargs, _ = recipe
            return type(self), args, kwargs, True
        cls, args, kwargs, _ = super().wrapper_recipe()
        if self.tokenizer is not None:
            kwargs["tokenizer"] = self.tokenizer
        return cls, args, kwargs, False


def _unchanged_since_load(module):
    """A check: does `module` still compute what it did when loaded (`fingerprint`)?

    A Ray sweep rebuilds a loaded model on its workers from the recipe only while this holds;
    a model changed since (weights edited or replaced, training flags, hooks, submodules,
    attributes) is shipped instead.
    """
    loaded = fingerprint(module)
    return lambda: fingerprint(module) == loaded


#: The tracer of `LanguageModel.trace`/`generate`: an InterleavingTracer (the name is kept for imports).
LanguageTracer = InterleavingTracer


class _Run:
    """What one run calls: the module (or its generate) on the batched inputs plus the
    keywords given to trace()/generate() for the whole batch."""

    __slots__ = ("module", "kwargs")
    what = "model.trace(...)"

    def __init__(self, module, kwargs):
        self.module = module
        self.kwargs = kwargs

    def _merge(self, inputs):
        both = sorted(set(inputs) & set(self.kwargs))
        if both:
            raise TypeError(f"{', '.join(both)} given both to {self.what} and to an invoke; give it once")
        return {**inputs, **self.kwargs}

    def __call__(self, *args, **inputs):
        return self.module(*args, **self._merge(inputs))


class _Forward(_Run):
    __slots__ = ()


class _Generation(_Run):
    __slots__ = ()
    generates = True  # PromptBatcher.for_run batches a generation's prompts for it
    what = "model.generate(...)"

    def __call__(self, *args, **inputs):
        try:
            return self.module.generate(*args, **self._merge(inputs))
        except ValueError as error:
            if "model_kwargs` are not used by the model" not in str(error):
                raise
            raise UnknownKeywordError(
                f"model.generate(...) got keywords that neither generation nor the model take: "
                f"{error}"
            ) from None


LanguageModel.trace = compiled_trace(LanguageModel.trace)


def _split_prompt(kwargs):
    """(the prompt's keywords, everything else) of a trace()/generate() call."""
    if "position_ids" in kwargs:
        raise TypeError(POSITION_IDS)
    prompt = {k: kwargs.pop(k) for k in ("input_ids", "attention_mask") if k in kwargs}
    return prompt, kwargs


class TransformersModel(LanguageModel):
    """nnsight 0.8's preferred name for a transformers model: `TransformersModel(repo_id,
    task="text-generation")`. The same wrapper as `LanguageModel`; `task=` picks the Auto
    class the weights load with."""
