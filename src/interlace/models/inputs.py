"""Turning what users pass as prompts into the tensors a causal language model needs.

Accepted forms: a string, a list of strings, token ids (a list of ints, a list of lists of
ints, a 1-D or 2-D tensor), or a tokenizer's `BatchEncoding`/dict with `input_ids` (and
optionally `attention_mask`). Everything becomes one left-padded batch:
`{"input_ids", "attention_mask"}`, both 2-D `long` tensors.

Why left padding and explicit `position_ids`: a decoder-only model generates from the last
column, so every prompt must end there; and a left-padded prompt must still see positions
0, 1, 2... from its first real token, otherwise its logits differ from the same prompt run
alone (the footgun style.md names: "batched runs that silently differ from single runs").
`position_ids` are therefore computed from the final attention mask, after all invokes'
prompts have been batched together -- never per invoke.

`prepare` (one invoke's inputs -> batch), `combine` (several invokes' batches -> one batch
plus each invoke's row slice) and `position_ids` (from a mask) are plain functions;
`PromptBatcher` is the batching strategy a `LanguageModel` gives its engine.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections import namedtuple
from collections.abc import Mapping

import torch

from ..errors import UnknownKeywordError  # re-exported: its home is interlace.errors
from ..intervention.batching import Batcher, BatchingError, Prepared, rows_slices

_prepared = tuple.__new__  # a Prepared made by one C call (as Batcher.prepare makes them)


class PromptPrepared(namedtuple("PromptPrepared", ("args", "kwargs", "rows", "prompt", "trimmed")),
                     Prepared):
    """One invoke's inputs as `PromptBatcher.prepare` leaves them: a `Prepared` (no args, the
    other keywords, the prompt's rows) with the tokenized `prompt` batch and its rows without
    their own padding (`trimmed`, from `trim`; None: it has none). A `prompt` given as one
    tensor of ids is kept as that 2-D tensor (no padding, no mask yet: `batch` makes them).
    A named tuple, made by one C call per invoke."""

    __slots__ = ()


_IDS = operator.itemgetter("input_ids")
_KEYS = operator.methodcaller("keys")
_KWARGS = operator.attrgetter("kwargs")
_PROMPT = operator.attrgetter("prompt")
_TRIMMED = operator.attrgetter("trimmed")
_MODULES = operator.attrgetter("_modules")  # a torch module's children by name
_INVOKE_ARGS = operator.itemgetter(1)  # an invoke's (fn, args, kwargs) parts
_INVOKE_KWARGS = operator.itemgetter(2)
_FIRST = operator.itemgetter(0)
_DTYPE = operator.attrgetter("dtype")

ACCEPTED = (
    "a string, a list of strings, token ids (a list of ints, a list of lists of ints, or a "
    "1-D/2-D integer tensor), or a tokenizer's BatchEncoding/dict with 'input_ids'"
)

# Per-token keys a tokenizer may return, and the value that pads each of them.
_PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0, "labels": -100}


def pad_token_id(tokenizer) -> int:
    """The id used for padding: the tokenizer's pad token, else its eos token, else 0."""
    if tokenizer is not None:
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tokenizer, attr, None)
            if value is not None:
                return int(value)
    return 0


def prepare(inputs, tokenizer=None, *, attention_mask=None, strip=False) -> dict[str, torch.Tensor]:
    """One invoke's prompts -> a batch `{"input_ids", "attention_mask", ...}`.

    Token ids (and tokenizer output) of one width are kept as given, padding and all (what
    the user tokenized is what the model gets); rows of different widths, or any rows when
    `strip` (a generation, which continues from the last column), lose their padding and
    are left-padded together. `attention_mask` is the mask a user passed beside token ids
    (`trace(ids, attention_mask=m)`). Raises `ValueError` for empty prompts and `TypeError`
    for forms we do not accept.
    """
    if type(inputs) is torch.Tensor and attention_mask is None and not strip:
        return _ids_batch(inputs)  # the common form: one tensor of ids, nothing to pad
    rows = _rows(inputs, tokenizer, attention_mask)
    if strip:
        rows = [_strip(row) for row in rows]
    return _pad(rows, tokenizer)


class _Unpadded(dict):
    """A batch made from a tensor of ids with no mask (`_ids_batch`): it has no padding, so
    `trim` need not search its mask."""

    __slots__ = ()


def _ids_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A tensor of ids (1-D or 2-D) as a batch, what `_rows_from_ids` and `_pad` make of it
    in two torch ops (the ids a copy, as stacking its rows made them: an in-place edit of
    the model's input never reaches the user's tensor)."""
    long = _check_ids(ids, "input_ids")  # (`.long()`: a copy unless they are long already)
    if long is ids:
        long = ids.clone(memory_format=torch.contiguous_format)
    if long.dim() == 1:
        long = long.unsqueeze(0)
    return _Unpadded(input_ids=long, attention_mask=torch.ones_like(long))


def trim(batch) -> list[dict[str, torch.Tensor]] | None:
    """The rows of `batch` without their own padding, or None when it has none (computed from
    real tensors: a scan batches fake ones, whose masks cannot be searched)."""
    if type(batch) is _Unpadded:
        return None
    mask = batch.get("attention_mask")
    try:
        if mask is None or bool(mask.all()):
            return None
    except RuntimeError:  # a scan's fake tensor has no values: its rows stay as they are
        return None
    n = batch["input_ids"].shape[0]
    return [_strip({k: v[i] for k, v in batch.items()}) for i in range(n)]


def combine(batches, tokenizer=None, trimmed=None) -> tuple[dict[str, torch.Tensor], list[slice]]:
    """Several invokes' batches -> one batch, and each invoke's rows. Batches of one width are
    stacked as given; batches of different widths lose their own padding (`trimmed[i]`, from
    `trim`) and are left-padded to the longest."""
    if not batches:
        raise ValueError("there are no inputs to batch: give trace() or an invoke() a prompt")
    keys = batches[0].keys()
    if not all(map(operator.eq, map(_KEYS, batches), itertools.repeat(keys))):
        batch = next(b for b in batches if b.keys() != keys)
        raise BatchingError(
            "cannot batch these invokes: their inputs carry different fields "
            f"({sorted(keys)} vs {sorted(batch)}); pass the same kind of input to every invoke"
        )
    if len(batches) == 1:  # the common case: one prompt batch, already padded
        return dict(batches[0]), [slice(0, batches[0]["input_ids"].shape[0])]
    ids = list(map(_IDS, batches))
    if len(set(map(torch.Tensor.size, ids, itertools.repeat(1)))) == 1:
        # one width: each field's batches stacked as given, one op per field (no step per batch)
        return {key: torch.cat(ids if key == "input_ids" else list(map(operator.itemgetter(key), batches)))
                for key in keys}, rows_slices(map(len, ids))
    rows, slices, start = [], [], 0
    for i, batch in enumerate(batches):
        n = batch["input_ids"].shape[0]
        own = trimmed[i] if trimmed is not None else trim(batch)
        rows.extend(own if own is not None else ({k: v[j] for k, v in batch.items()} for j in range(n)))
        slices.append(slice(start, start + n))
        start += n
    return _pad(rows, tokenizer), slices


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token (0 on padding), as generate does."""
    mask = attention_mask.long()
    positions = mask.cumsum(-1)
    positions.sub_(1)  # -1 before a row's first token, and 0 where the mask is 0 after this:
    return positions.mul_(mask)


# --- normalising every accepted form into rows --------------------------------------------


def _rows(inputs, tokenizer, attention_mask) -> list[dict[str, torch.Tensor]]:
    """Normalise `inputs` to a list of rows `{"input_ids": 1-D, "attention_mask": 1-D, ...}`."""
    if isinstance(inputs, Mapping):  # BatchEncoding is a UserDict, hence a Mapping
        if attention_mask is not None and "attention_mask" in inputs:
            raise TypeError(
                "attention_mask was given twice: inside the input dict and as a keyword; "
                "pass it once"
            )
        return _rows_from_mapping(inputs, attention_mask)
    if isinstance(inputs, str):
        return _rows_from_strings([inputs], tokenizer, attention_mask)
    if isinstance(inputs, torch.Tensor):
        return _rows_from_ids(inputs, attention_mask)
    if isinstance(inputs, (list, tuple)):
        if len(inputs) == 0:
            raise ValueError(
                "the list of prompts is empty: pass at least one prompt (" + ACCEPTED + ")"
            )
        if all(isinstance(x, str) for x in inputs):
            return _rows_from_strings(list(inputs), tokenizer, attention_mask)
        if all(_is_int(x) for x in inputs):
            return _rows_from_ids(torch.tensor(list(inputs), dtype=torch.long), attention_mask)
        if all(isinstance(x, (list, tuple, torch.Tensor)) for x in inputs):
            return _rows_from_id_lists(inputs, attention_mask)
        kinds = sorted({type(x).__name__ for x in inputs})
        raise TypeError(
            f"cannot use a list of {', '.join(kinds)} values as prompts: a list must hold only strings, "
            f"only ints (token ids), or only lists of ints; accepted inputs are {ACCEPTED}"
        )
    raise TypeError(
        f"cannot use a value of type {type(inputs).__name__} as a prompt; accepted inputs are "
        f"{ACCEPTED}"
    )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or (
        isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point()
    )


def _rows_from_strings(texts, tokenizer, attention_mask):
    if tokenizer is None:
        raise TypeError(
            "string prompts need a tokenizer, and this LanguageModel has none: pass "
            "tokenizer=... when wrapping a module, or pass token ids instead of text"
        )
    if attention_mask is not None:
        raise TypeError(
            "attention_mask was passed with text prompts; the mask is built from the text, "
            "so pass attention_mask only with token ids"
        )
    for i, text in enumerate(texts):
        if text == "":
            raise ValueError(f"prompt {i} is an empty string: there is nothing to run the model on")
    encoded = tokenizer(texts, padding=False, return_attention_mask=True)
    rows = []
    for i, ids in enumerate(encoded["input_ids"]):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} ({texts[i]!r}) tokenizes to no tokens")
        row = {"input_ids": torch.tensor(ids, dtype=torch.long)}
        row["attention_mask"] = torch.tensor(encoded["attention_mask"][i], dtype=torch.long)
        if "token_type_ids" in encoded:
            row["token_type_ids"] = torch.tensor(encoded["token_type_ids"][i], dtype=torch.long)
        rows.append(row)
    return rows


def _check_ids(ids: torch.Tensor, what: str) -> torch.Tensor:
    dtype = ids.dtype
    if dtype not in _ID_DTYPES and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        raise TypeError(f"{what} must be integer token ids, got a tensor of dtype {dtype}")
    shape = ids.shape
    if len(shape) not in (1, 2):
        raise ValueError(
            f"{what} must be 1-D (one prompt) or 2-D (batch, tokens), got shape {tuple(shape)}"
        )
    if not shape[-1] or not shape[0]:
        raise ValueError(f"{what} is empty (shape {tuple(shape)}): pass at least one token")
    return ids if dtype is torch.long else ids.long()


_ID_DTYPES = frozenset((torch.long, torch.int32, torch.int16, torch.int8, torch.uint8))
_LONG = torch.long


def _rows_from_ids(ids: torch.Tensor, attention_mask):
    ids = _check_ids(ids, "input_ids")
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        mask = torch.as_tensor(attention_mask).long()
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
        if mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape "
                f"{tuple(ids.shape)}; they must match"
            )
        if not bool(mask.any(-1).all()):
            raise ValueError("a prompt's attention_mask is all zeros: there is nothing to run "
                             "the model on")
    return [{"input_ids": ids[i], "attention_mask": mask[i].to(ids.device)} for i in range(ids.shape[0])]


def _rows_from_id_lists(lists, attention_mask):
    if attention_mask is not None:
        raise TypeError(
            "attention_mask cannot be combined with a list of token-id lists (they are padded "
            "for you); pass a 2-D tensor of ids with a mask of the same shape instead"
        )
    rows = []
    for i, ids in enumerate(lists):
        tensor = ids if isinstance(ids, torch.Tensor) else None
        if tensor is None:
            if not all(_is_int(x) for x in ids):
                raise TypeError(f"prompt {i} must be a list of int token ids, got {ids!r:.60}")
            tensor = torch.tensor(list(ids), dtype=torch.long)
        tensor = _check_ids(tensor, f"prompt {i}")
        if tensor.dim() != 1:
            raise ValueError(f"prompt {i} must be 1-D token ids, got shape {tuple(tensor.shape)}")
        rows.append({"input_ids": tensor, "attention_mask": torch.ones_like(tensor)})
    return rows


def _rows_from_mapping(mapping, attention_mask):
    if "input_ids" not in mapping:
        raise TypeError(
            f"an input dict must contain 'input_ids' (it has {sorted(mapping)}); "
            "pass the output of tokenizer(...) or {'input_ids': ..., 'attention_mask': ...}"
        )
    unknown = sorted(set(mapping) - {"input_ids", *_PAD_VALUES})
    if unknown:
        raise TypeError(
            f"cannot batch the input dict's fields {unknown}: only 'input_ids', "
            f"{', '.join(repr(k) for k in _PAD_VALUES)} are per-token inputs we know how to pad; "
            "pass other model arguments as keywords to trace()/generate()"
        )
    ids = mapping["input_ids"]
    ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
    mask = mapping.get("attention_mask", attention_mask)
    rows = _rows_from_ids(ids, mask)
    for key in set(mapping) - {"input_ids", "attention_mask"}:
        value = torch.as_tensor(mapping[key]).long()
        value = value.unsqueeze(0) if value.dim() == 1 else value
        for i, row in enumerate(rows):
            row[key] = value[i]
    return rows


def _strip(row):
    """Drop padding from a row whose mask is one contiguous run of ones (left or right padded).

    Rows of different widths batched together, and a generation's rows, are re-padded on the
    left (a generation continues from the last column). A mask with holes is kept as the
    user gave it.
    """
    mask = row["attention_mask"]
    if mask.dim() != 1:
        return row
    ones = mask.nonzero().flatten()
    if len(ones) == 0:
        raise ValueError("a prompt's attention_mask is all zeros: there is nothing to run the model on")
    first, last = int(ones[0]), int(ones[-1])
    if int(mask[first : last + 1].sum()) != last - first + 1:
        return row
    return {k: v[first : last + 1] for k, v in row.items()}


def _pad(rows, tokenizer) -> dict[str, torch.Tensor]:
    """Stack rows of one width as they are; left-pad rows of different widths to the longest
    (with the tokenizer's pad id)."""
    lengths = [row["input_ids"].shape[0] for row in rows]
    length = max(lengths)
    if min(lengths) == length:
        return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    pad_id = pad_token_id(tokenizer)
    out = {}
    for key in rows[0]:
        fill = pad_id if key == "input_ids" else _PAD_VALUES[key]
        column = []
        for row in rows:
            value = row[key]
            pad = value.new_full((length - len(value),), fill)
            column.append(torch.cat([pad, value]))
        out[key] = torch.stack(column)
    return out


# --- the engine's batching strategy -----------------------------------------------------------


class PromptBatcher(Batcher):
    """Batching for language models: prompts are tokenized, left-padded across invokes.

    Each invoke's prompt becomes `input_ids`/`attention_mask` rows; all invokes are padded
    together to the longest, and `position_ids` come from the final mask (when the model
    takes them). Other keywords must agree across invokes, as for any model. A generation
    (`for_run` of a run that `generates`) leaves positions to transformers and its keywords
    to `generate`'s own check.

    It holds the module and the tokenizer, never the wrapper: the wrapper's engine holds it.
    """

    as_given = False  # even one prompt is tokenized and padded
    batch_first = True  # token ids are (batch, tokens), always

    def __init__(self, module, tokenizer, *, generate=False):
        self.module = module
        self.tokenizer = tokenizer
        self.generate = generate
        self._signature = None  # (forward function, named parameters, accepted keywords)
        self._generating = None
        self._embedding_path = None  # names from the module to its input embeddings, once found
        self._kept_ones = None  # the last mask of ones and its positions, given again (`_ones`)

    def for_run(self, run):
        if self.generate or not getattr(run, "generates", False):
            return self
        if self._generating is None:
            self._generating = PromptBatcher(self.module, self.tokenizer, generate=True)
        return self._generating

    def prepare(self, args, kwargs):
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor and not self.generate:
            # the common invoke: one tensor of ids, nothing else to check or pad. Its prompt is
            # the ids themselves (2-D, perhaps the user's own tensor): `batch` makes the copy
            # and the mask once for all invokes
            ids = args[0]
            if not (ids.dtype is _LONG and ids.dim() == 2 and ids.numel()):  # (else checked)
                ids = _check_ids(ids, "input_ids")
                if ids.dim() == 1:
                    ids = ids.unsqueeze(0)
            return _prepared(PromptPrepared, ((), {}, len(ids), ids, None))
        batch, rest = self.prepare_inputs(*args, **kwargs)
        if not self.generate:  # generate() validates its own keywords
            self.check_forward_kwargs(rest)
        # (trimmed now: a scan batches fake tensors)
        return PromptPrepared((), rest, batch["input_ids"].shape[0], batch, trim(batch))

    def batch(self, prepared):
        if any(map(_KWARGS, prepared)):
            _, rest = super().batch([Prepared((), p.kwargs, p.rows) for p in prepared])
        else:  # (no invoke passes keywords besides its prompt: nothing to agree on)
            rest = {}
        prompts = list(map(_PROMPT, prepared))
        if all(map(isinstance, prompts, itertools.repeat(torch.Tensor))) and len(
                set(map(torch.Tensor.size, prompts, itertools.repeat(1)))) == 1:
            # every prompt is ids of one width (`prepare`'s common invoke): stacked (a copy,
            # even of one: an in-place edit of the model's input never reaches the user's
            # tensor), with one mask of ones
            return (), self._ids_kwargs(torch.cat(prompts), rest)
        prompts = [_ids_batch(p) if isinstance(p, torch.Tensor) else p for p in prompts]
        combined, _ = combine(prompts, self.tokenizer, list(map(_TRIMMED, prepared)))
        return (), self.model_kwargs(combined, rest, positions=not self.generate)

    def batch_invokes(self, invokes):
        """The invokes that each pass one 2-D tensor of token ids (int64, not empty) of one
        width and nothing else (`tracer.invoke(ids)` in a loop), batched with no step per
        invoke: what `prepare`, `batch` and `slices` give them. None for anything else."""
        if self.generate or any(map(_INVOKE_KWARGS, invokes)):
            return None
        args = list(map(_INVOKE_ARGS, invokes))
        if not all(map(operator.eq, map(len, args), itertools.repeat(1))):
            return None
        prompts = list(map(_FIRST, args))
        if not all(map(operator.is_, map(type, prompts), itertools.repeat(torch.Tensor))):
            return None
        try:
            ids = torch.cat(prompts)
        except (RuntimeError, TypeError):  # widths, dims or devices differ: `prepare` says how
            return None
        if ids.dim() != 2 or not all(map(torch.Tensor.numel, prompts)) or not all(
                map(operator.is_, map(_DTYPE, prompts), itertools.repeat(_LONG))):
            return None
        return (), self._ids_kwargs(ids, {}), rows_slices(map(torch.Tensor.size, prompts, itertools.repeat(0)))

    def _ids_kwargs(self, ids, rest):
        """The model's keywords for `ids` (a batch of unpadded prompts, a new tensor): one mask
        of ones, and positions when the forward takes them."""
        ids = ids.to(self.input_device)
        mask, positions = self._ones(ids, not self.generate and "position_ids" in self.forward_signature()[0])
        out = {"input_ids": ids, "attention_mask": mask}
        out.update(rest)
        if positions is not None:
            out["position_ids"] = positions
        return out

    def _ones(self, ids, positions):
        """A mask of ones shaped like `ids` and, when `positions`, its positions (0, 1, ...
        per row). Three torch operators a trace, so the last pair is kept and given again
        while nobody else holds it and neither tensor changed since it was made (its version
        counter): what a model gets is a fresh pair's values, and a pair a user kept (saved
        `model.inputs`) or edited is never handed to a later trace. Only plain tensors are
        kept and given: a scan's fake ones are neither."""
        kept = self._kept_ones
        if kept is not None and type(ids) is torch.Tensor:  # (not a scan's fake ids)
            mask, version, kept_positions, positions_version, alone = kept
            # (`alone`: each tensor's reference count here, with nobody else holding it)
            if ((kept_positions is not None) == positions and mask.shape == ids.shape
                    and mask.device == ids.device and mask.dtype is ids.dtype
                    and mask._version == version and sys.getrefcount(mask) <= alone
                    and (kept_positions is None or (kept_positions._version == positions_version
                                                    and sys.getrefcount(kept_positions) <= alone))):
                return mask, kept_positions
        self._kept_ones = None
        mask = torch.ones_like(ids)
        # `position_ids(mask)` of a mask of ones, in two ops instead of four
        made = mask.cumsum(-1).sub_(1) if positions else None
        # (a scan's fake tensors are not kept, nor inference tensors: no version counter)
        if type(mask) is torch.Tensor and not mask.is_inference():
            kept = self._kept_ones = [mask, mask._version, made, made._version if positions else 0, 0]
            kept[4] = sys.getrefcount(mask)  # (the list, `mask` and the argument, as above)
        return mask, made

    # -- what LanguageModel's public methods of the same names do -------------------------------

    def prepare_inputs(self, *args, **kwargs) -> tuple[dict, dict]:
        """One invoke's `(args, kwargs)` -> (`batch` of padded tensors, other model kwargs)."""
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
            raise TypeError(POSITION_IDS)
        batch = prepare(prompt, self.tokenizer, attention_mask=attention_mask, strip=self.generate)
        return batch, kwargs

    def model_kwargs(self, batch: dict, kwargs: dict, *, positions=True) -> dict:
        """The module's keyword inputs: the batch on the input device, positions, the rest."""
        device = self.input_device
        out = {k: v.to(device) for k, v in batch.items()}
        if positions and "position_ids" in self.forward_signature()[0]:
            out["position_ids"] = position_ids(out["attention_mask"])
        out.update(kwargs)
        return out

    def check_forward_kwargs(self, kwargs):
        """Refuse keywords the model's forward would silently drop (generate checks its own)."""
        if not kwargs:
            return
        named, allowed = self.forward_signature()
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            known = sorted(named - _MANAGED - {"self"})
            raise UnknownKeywordError(
                f"{type(self.module).__name__}.forward does not take "
                f"{', '.join(repr(u) for u in unknown)}; it takes {', '.join(known)}. "
                "Generation options (max_new_tokens=, do_sample=...) belong to model.generate()"
            )

    def forward_signature(self):
        """(named parameters, accepted keywords) of the module's forward, read once."""
        import inspect

        forward = self.module.forward
        key = getattr(forward, "__func__", forward)
        cached = self._signature
        if cached is None or cached[0] is not key:
            params = inspect.signature(forward).parameters
            named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            takes_var = any(p.kind == p.VAR_KEYWORD for p in params.values())
            allowed = named | (_IMPLICIT_FORWARD_KWARGS if takes_var else set())
            cached = self._signature = (key, named, allowed)
        return cached[1], cached[2]

    @property
    def input_device(self) -> torch.device:
        """Where input ids must live: the embedding's device (accelerate may spread the rest)."""
        module = self.module
        try:
            embed = self._input_embeddings()
            weight = getattr(embed, "weight", None)
            if weight is not None and weight.device.type != "meta":
                return weight.device
        except (AttributeError, NotImplementedError):
            pass
        for p in module.parameters():
            if p.device.type != "meta":
                return p.device
        return torch.device("cpu")

    def _input_embeddings(self):
        """`module.get_input_embeddings()`, without its cost on every run: transformers' generic
        version walks its fallbacks (about 5 us, paid by every trace of a language model). The
        embedding's path in the module tree is found once and walked after, so that a
        `set_input_embeddings`, a resize or a replaced submodule is still seen."""
        path = self._embedding_path
        if path:
            embed = self.module
            modules = _MODULES
            for name in path:
                embed = modules(embed).get(name)
                if embed is None:  # (the tree changed there: found again)
                    path = None
                    break
            else:
                return embed
        embed = self.module.get_input_embeddings()
        if path is None:  # (an embedding outside the tree, or the root: () - asked every time)
            self._embedding_path = next((tuple(name.split(".")) for name, sub in
                                         self.module.named_modules() if sub is embed and name), ())
        return embed


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

POSITION_IDS = (
    "position_ids are computed from the attention mask after batching so that padded prompts "
    "match their unpadded runs; do not pass position_ids="
)
