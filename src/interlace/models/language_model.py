"""`LanguageModel`: a `Model` over a `transformers` causal LM, with its tokenizer.

What it adds to `Model`: loading by repo id or folder, turning prompts (text, token ids,
tokenizer output) into one left-padded batch with `position_ids`, and `generate`.
"""

from __future__ import annotations

import contextvars
import inspect

import torch

from ..errors import InterlaceError
from ..intervention.tracer import InterleavingTracer
from . import inputs as _inputs
from .loading import automodel_for_task, load_model, load_tokenizer, resolve_dtype
from ..intervention.session import check_remote
from .model import Model

# Whether the run being prepared is a generation (set around `_interleave`, per context so
# two threads tracing the same model cannot see each other's mode).
_GENERATING = contextvars.ContextVar("interlace_generating", default=False)

# Keywords transformers' causal LMs take through **kwargs (TransformersKwargs) or through a
# decorator (return_dict, the deprecated past_key_values), which a signature does not show.
_IMPLICIT_FORWARD_KWARGS = {
    "return_dict",
    "past_key_values",
    "output_attentions",
    "output_hidden_states",
    "output_router_logits",
    "num_items_in_batch",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "is_causal",
    "seq_idx",
}
# The inputs interlace builds itself from the prompts.
_MANAGED = {"input_ids", "attention_mask", "position_ids"}


class UnknownKeywordError(InterlaceError, TypeError, ValueError):
    """A keyword the model (trace) or transformers' generate (generate) does not take.

    A `TypeError`, as Python raises for an unexpected keyword, and a `ValueError`, as
    transformers' generate raises for unused model kwargs, so either `except` catches it.
    """


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
        super().__init__(module, rename=rename, envoys=envoys)
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

    def trace(self, *args, remote=False, **kwargs):
        """`with model.trace(prompt, **forward_kwargs) as tracer:` - one forward pass.

        `prompt` is text, a list of texts, token ids or a tokenizer's output; several prompts
        are left-padded into one batch with matching `attention_mask` and `position_ids`.
        Without a prompt, give each one its own `with tracer.invoke(prompt):`. Other keywords
        (`output_hidden_states=True`, ...) go to the model's forward for the whole batch and
        are checked now: transformers' forward would silently ignore a misspelt one.
        """
        check_remote(remote, "model.trace")
        prompt, rest = _split_prompt(kwargs)
        self.check_forward_kwargs(rest)
        run = _Forward(self._module, rest) if rest else None
        return LanguageTracer(self, args, prompt, run=run)

    def generate(self, *args, remote=False, **kwargs):
        """`with model.generate(prompt, max_new_tokens=N, **generate_kwargs) as tracer:`.

        Runs `transformers` generation with the body interleaved. Each new token is one call
        of the model, one *step*: reads and edits bind to step 0 unless a
        `for step in tracer.iter[...]:` loop (or `tracer.all()`) pins them to other steps.
        `tracer.result` is what `generate` returns (the prompt ids followed by the new ones).
        Without a prompt (`model.generate(max_new_tokens=N)`), give each prompt its own
        `with tracer.invoke(prompt):`; the keywords here apply to the whole generation.
        """
        check_remote(remote, "model.generate")
        prompt, rest = _split_prompt(kwargs)
        config = getattr(self._module, "generation_config", None)
        if "pad_token_id" not in rest and getattr(config, "pad_token_id", None) is None:
            # The id we pad with; transformers would otherwise log a warning per generation.
            rest["pad_token_id"] = _inputs.pad_token_id(self.tokenizer)
        return LanguageTracer(self, args, prompt, run=_Generation(self._module, rest))

    def sweep(self, items, input=None, *, batch_size=None, progress=True, executor="local",
              workers=None, generate=False, **kwargs):
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
        if generate:
            config = getattr(self._module, "generation_config", None)
            if "pad_token_id" not in kwargs and getattr(config, "pad_token_id", None) is None:
                kwargs["pad_token_id"] = _inputs.pad_token_id(self.tokenizer)
            eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
            eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
            run = _Generation(self._module, kwargs)
        else:
            self.check_forward_kwargs(kwargs)
            run = _Forward(self._module, kwargs) if kwargs else None
        return SweepTracer(self, items, input, batch_size=batch_size, progress=progress,
                           executor=executor, workers=workers, generate=generate, run=run,
                           eos=eos)

    def _interleave(self, invokes, run=None, **options):
        token = _GENERATING.set(getattr(run, "generates", False))
        try:
            return super()._interleave(invokes, run, **options)
        finally:
            _GENERATING.reset(token)

    def _batcher(self):
        return _inputs.PromptBatcher(self, generate=_GENERATING.get())

    # --- inputs: the hooks the engine's batching calls ----------------------------------

    def prepare_inputs(self, *args, **kwargs) -> tuple[dict, dict]:
        """One invoke's `(args, kwargs)` -> (`batch` of padded tensors, other model kwargs).

        The prompt is the single positional argument, or `input_ids=` (with optional
        `attention_mask=`) given as keywords. Other keywords are returned as they are (the
        batcher checks them against the model's forward when tracing).
        """
        if len(args) > 1:
            raise TypeError(
                f"got {len(args)} positional inputs; pass one prompt (or a list of prompts) "
                "per trace/invoke, or use several tracer.invoke(...) blocks"
            )
        attention_mask = kwargs.pop("attention_mask", None)
        if args:
            if "input_ids" in kwargs:
                raise TypeError("the prompt was given twice: positionally and as input_ids=")
            prompt = args[0]
        elif "input_ids" in kwargs:
            prompt = kwargs.pop("input_ids")
        else:
            raise TypeError(
                "no prompt was given: pass a string, a list of strings, token ids or a "
                "tokenizer's output, e.g. model.trace('The Eiffel Tower is in')"
            )
        if "position_ids" in kwargs:
            raise TypeError(_POSITION_IDS)
        batch = _inputs.prepare(prompt, self.tokenizer, attention_mask=attention_mask)
        return batch, kwargs

    def model_kwargs(self, batch: dict, kwargs: dict, *, positions=True) -> dict:
        """The module's keyword inputs: the batch on the input device, positions, the rest.

        `position_ids` come from the final mask. Generation passes `positions=False`:
        transformers' generate computes the very same positions from the mask itself (and
        extends them per step more cheaply than when they are given).
        """
        device = self.input_device
        out = {k: v.to(device) for k, v in batch.items()}
        if positions and self._accepts("position_ids"):
            out["position_ids"] = _inputs.position_ids(out["attention_mask"])
        out.update(kwargs)
        return out

    def check_forward_kwargs(self, kwargs):
        """Refuse keywords the model's forward would silently drop (generate checks its own)."""
        if not kwargs:
            return
        named, allowed = self._forward_signature()
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            known = sorted(named - _MANAGED - {"self"})
            raise UnknownKeywordError(
                f"{type(self._module).__name__}.forward does not take "
                f"{', '.join(repr(u) for u in unknown)}; it takes {', '.join(known)}. "
                "Generation options (max_new_tokens=, do_sample=...) belong to model.generate()"
            )

    def _accepts(self, name) -> bool:
        return name in self._forward_signature()[0]

    def _forward_signature(self):
        """(named parameters, accepted keywords) of the module's forward, read once."""
        forward = self._module.forward
        key = getattr(forward, "__func__", forward)
        cached = self.__dict__.get("_signature")
        if cached is None or cached[0] is not key:
            params = inspect.signature(forward).parameters
            named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            takes_var = any(p.kind == p.VAR_KEYWORD for p in params.values())
            allowed = named | (_IMPLICIT_FORWARD_KWARGS if takes_var else set())
            cached = (key, named, allowed)
            object.__setattr__(self, "_signature", cached)
        return cached[1], cached[2]

    @property
    def input_device(self) -> torch.device:
        """Where input ids must live: the embedding's device (accelerate may spread the rest)."""
        module = self._module
        try:
            embed = module.get_input_embeddings()
            weight = getattr(embed, "weight", None)
            if weight is not None and weight.device.type != "meta":
                return weight.device
        except (AttributeError, NotImplementedError):
            pass
        for p in module.parameters():
            if p.device.type != "meta":
                return p.device
        return torch.device("cpu")


def _unchanged_since_load(module):
    """A check: are `module`'s weights still the ones loaded (no tensor replaced or edited)?

    A Ray sweep rebuilds a loaded model on its workers from the recipe only while this holds;
    weights edited in place after loading (version counters) or replaced are shipped instead.
    """

    def weights():
        return [(id(t), t._version, t.data_ptr()) for t in module.parameters()] + [
            (id(t), t._version, t.data_ptr()) for t in module.buffers()]

    loaded = weights()
    return lambda: weights() == loaded


class LanguageTracer(InterleavingTracer):
    """The tracer of `LanguageModel.trace`/`generate` (`iter`/`all` come from every interleaving tracer)."""


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
    generates = True  # LanguageModel._interleave batches a generation's prompts for it
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


def _split_prompt(kwargs):
    """(the prompt's keywords, everything else) of a trace()/generate() call."""
    if "position_ids" in kwargs:
        raise TypeError(_POSITION_IDS)
    prompt = {k: kwargs.pop(k) for k in ("input_ids", "attention_mask") if k in kwargs}
    return prompt, kwargs


_POSITION_IDS = (
    "position_ids are computed from the attention mask after batching so that padded prompts "
    "match their unpadded runs; do not pass position_ids="
)


class TransformersModel(LanguageModel):
    """nnsight 0.8's preferred name for a transformers model: `TransformersModel(repo_id,
    task="text-generation")`. The same wrapper as `LanguageModel`; `task=` picks the Auto
    class the weights load with."""
