"""Grouping sweep items into batches, and running one batch as one forward pass.

A batch is one `Engine.interleave(...)` call with one mediator per item (an `ItemBody`): the
engine batches the items' inputs exactly as it batches invokes (with the model's own
batching strategy) and shows each body only its own rows. What this module adds is what a sweep needs on top:

- `Job`: everything a batch needs, built once per sweep (and shipped once per Ray worker),
  and `Job.entry`, one item with its input and its *batch key*;
- batch keys: a batch only holds items whose inputs have the same shape beyond the batch
  dimension (for a language model: the same padded width in tokens), so no item is ever
  padded for another's sake and its values, shapes included, equal its values alone.
  `plan_batches` groups a window of items by key, in order of first appearance;
- `run_batch`: one batch -> each item's saved values, compacted so that no saved view pins
  the batch's tensors (with `save_to=`, the store compacts what it keeps past the batch, and
  writes the rest straight from the batch's tensors: a copy per item less);
- `Runner`: the failure policy. Out of memory: split the batch in halves and retry (and keep
  the smaller size for later batches). An item's body raised: run the items before it that
  have not finished (the failing batch was unwound) and raise the error, so that the
  finished items are exactly those before the failing one, whatever the batching. The model
  raised without naming an item: run the batch's items alone; one that raises alone is named,
  and if none does the error was the batch's own (a keyword with one row for the whole
  batch): warn once and run the rest of the sweep with batch size 1. Ctrl-C: stop at once.
- `InOrder`: commits finished items to the results in item order;
- `choose_batch_size`: the automatic size, from the input length and (on a GPU) free memory.

A retried batch runs its bodies again: their side effects (a print, an append to a caller's
list) happen again; their saved values are recorded once, from the run that finished.
"""

from __future__ import annotations

import itertools
import operator
import warnings

import torch

from ..errors import BatchingWarning, InterlaceError
from ..intervention import routes
from ..intervention.access import engine_of, module_of
from ..intervention.batching import BatchingError
from ..intervention.edit import replays
from ..tracing.save import TraceState
from .body import UNDECIDED, ItemBody, item_of, name_item
from .inputs import Inputs, split
from .results import compact, compact_all

_CPU_TOKENS = 2048  # tokens per batch on a CPU: per row, 1-2k-token batches were fastest
_GPU_TOKENS = 32768  # at most this many tokens per batch on an accelerator
_MAX_ITEMS = 512
WINDOW = 8  # items are grouped by batch key within windows of WINDOW batches


class Job:
    """What every batch of one sweep needs: the body, the caller's variables, the inputs rule.

    `input` is None (each item is the input), a callable (`input(item)`), or one value shared
    by every item; a value that is an `Inputs` gives several arguments (`inputs.py`). `run`
    replaces the model's forward (a language model's keywords, or its generation);
    `generate` marks a generation sweep, whose `eos` token ids trim each item's generated ids.
    """

    def __init__(self, tracer, namespace, input=None, kwargs=None, run=None, backward=False,
                 generate=False, eos=(), store=None):
        self.tracer = tracer
        self.namespace = namespace
        self.input = input
        self.kwargs = kwargs or {}
        self.run = _Recording(run) if generate else run
        self.backward = backward
        self.generate = generate
        self.eos = tuple(eos)
        self.store = store  # with save_to=: the folder (store.py)
        self.body = None  # the body's DeferredBody, shared by the items (body.ItemBody)
        self.states = []  # save states of finished items, for the next items (body.ItemBody)
        self.route_block = UNDECIDED  # the body's Block if items may run as generators, else None
        self.generator_start = None  # what starts the body as a generator, once made (body.ItemBody)

    def entries(self, model, items):
        """`items` as Entries (each with its inputs and batch key), made lazily; an item whose
        input cannot be made raises, named (and ends the stream).

        One generator step per item does it all (the input, `split`, the key, cached by
        input identity: a shared input is keyed once)."""
        source = self.input
        per_item = callable(source) and not isinstance(source, torch.nn.Module)
        shared = self.kwargs
        prepare = getattr(model, "prepare_inputs", None)  # looked up once, not per item
        if source is not None and not per_item:
            yield from self._shared_entries(prepare, items)
            return
        keys = {}
        route = UNDECIDED
        for index, item in enumerate(items):
            try:
                value = item if source is None else source(item) if per_item else source
                cached = keys.get(id(value))
                if cached is not None and cached[0] is value:  # a shared input: one key, and
                    _, key, args, kwargs = cached  # the same arguments (prepared once a batch)
                else:
                    if isinstance(value, Inputs):
                        args, kwargs = split(value, shared)
                    else:
                        args, kwargs = (value,), shared
                    key = batch_key(prepare, args, kwargs)
                    if len(keys) > 1024:
                        keys.clear()
                    keys[id(value)] = (value, key, args, kwargs)
            except Exception as error:
                name_item(error, index, item)
                raise
            if route is UNDECIDED:  # (the first item decides the job's route: `run_batch`)
                route = self.route()
            yield Entry(index, item, args, kwargs, key, self, route)

    def _shared_entries(self, prepare, items):
        """`entries` when every item passes the same input: its arguments and key are made
        once, at the first item (an error there names it), and the rest of the entries are
        made by one C-speed map (no generator step per item)."""
        items = iter(items)
        for first in items:
            try:
                value = self.input
                args, kwargs = split(value, self.kwargs) if isinstance(value, Inputs) else (
                    (value,), self.kwargs)
                made = (args, kwargs, batch_key(prepare, args, kwargs), self, self.route())
            except Exception as error:
                name_item(error, 0, first)
                raise
            yield Entry(0, first, *made)
            yield from map(Entry, itertools.count(1), items, *map(itertools.repeat, made))

    def deferred(self):
        """The sweep's one deferred body (its items differ only in their save state), made
        at the first need."""
        body = self.body
        if body is None:
            body = self.body = self.tracer.defer(self.namespace, state=TraceState(None))
        return body

    def route(self):
        """Every item's `route_block`: the body's Block when items may run as generators,
        None on greenlets (decided once per sweep)."""
        block = self.route_block
        if block is UNDECIDED:
            block = self.route_block = routes.eligible(self.deferred())
        return block


Entry = ItemBody
"""One item ready to run: `Entry(index, item, args, kwargs, key)` (its position, the item, its
inputs, its batch key). The item's body too (`body.ItemBody`): one object per item."""


class _Recording:
    """A generation run that keeps the batch's prompt mask (to trim each item's ids)."""

    __slots__ = ("inner", "mask")
    generates = True

    def __init__(self, inner):
        self.inner = inner
        self.mask = None

    def __call__(self, *args, **kwargs):
        self.mask = kwargs.get("attention_mask")
        return self.inner(*args, **kwargs)

    def __reduce__(self):
        return (_Recording, (self.inner,))


# -- batch keys -------------------------------------------------------------------------------


def batch_key(prepare, args, kwargs):
    """Items with equal keys batch without padding or changing each other's inputs
    (`prepare`: the model's `prepare_inputs`, or None)."""
    if prepare is not None:  # a language model: the padded width of the item's prompt(s)
        batch, rest = prepare(*args, **kwargs)
        return ("tokens", batch["input_ids"].shape[1], _value_key(rest))
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # the usual item
        return ("tuple", (("tuple", (_tensor_key(args[0]),)), ("dict", ())))
    return _value_key((args, kwargs))


def _tensor_key(value):
    return ("tensor", value.dtype, tuple(value.shape[1:]) if value.dim() else (), value.device)


def _value_key(value):
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _value_key(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return ("value", type(value), value)


_JOB = operator.attrgetter("job")
_KEY = operator.attrgetter("key")
_ARGS = operator.attrgetter("args")
_KWARGS = operator.attrgetter("kwargs")


def _in_item_order(entry):
    return entry.index


def plan_batches(entries, size):
    """`entries` (in item order) as batches of at most `size` entries of one key each."""
    if entries and all(map(operator.is_, map(_KEY, entries), itertools.repeat(entries[0].key))):
        groups = {None: entries}  # one key for all (a shared input's): in order already
    else:
        groups = {}
        for entry in entries:
            groups.setdefault(entry.key, []).append(entry)
    batches = []
    for group in groups.values():
        batches.extend(group[i:i + size] for i in range(0, len(group), size))
    batches.sort(key=lambda batch: batch[0].index)
    return batches


# -- one batch ------------------------------------------------------------------------------


def run_batch(model, job, entries):
    """Run `entries` as one forward pass; each item's saved values, in order.

    Raises what the batch raised; an error an item's body raised carries the item (see
    `body.item_of`).
    """
    # each entry is its item's body (an ItemBody), made by `job.entries` for this job; one
    # made elsewhere (sent to a Ray worker) is given the job here
    if not all(map(operator.is_, map(_JOB, entries), itertools.repeat(job))):
        block = job.route() if entries else None
        for entry in entries:
            entry.job = job
            entry.route_block = block
    runs = list(zip(entries, map(_ARGS, entries), map(_KWARGS, entries)))
    out = engine_of(model).interleave(runs, run=job.run, backward=job.backward,
                                      edits=replays(model))
    saved = []
    for entry in entries:  # nothing of the run stays on the entry (it may wait to be committed)
        values = entry.saved
        entry.saved = entry.observers = None
        saved.append(values or {})
    if job.store is None:  # (else the store compacts what it keeps past the batch)
        compact_all(saved)
    if job.generate and len(entries) > 1:
        # An item whose generation ended (eos) before its batch's saw, in a `tracer.iter`
        # loop, steps it would not have had alone: run it alone again.
        for position, entry in enumerate(entries):
            if entry.iter_rows is not None and _ended_early(job, out, entry.iter_rows):
                saved[position] = run_batch(model, job, [entry])[0]
    return saved


def trim_generated(ids, mask, eos):
    """One item's rows of a batch's generated ids, as its generation alone returns them.

    Drops the left padding the batch added (the columns every row of the item pads) and the
    steps after every row of the item produced an eos token (the batch went on for others).
    """
    if mask is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return ids
    mask = mask.to(ids.device)
    prompt = mask.shape[1]
    end = ids.shape[1]
    generated = ids[:, prompt:]
    if eos and generated.numel():
        hits = torch.isin(generated, torch.tensor(eos, device=ids.device))
        if bool(hits.any(1).all()):
            end = prompt + int(hits.int().argmax(1).max()) + 1
    return ids[:, _lead(mask):end]


def _ended_early(job, out, rows):
    """Did these rows' generation end before the batch's (so that alone it is shorter)?"""
    mask = job.run.mask
    if mask is None or not isinstance(out, torch.Tensor) or out.dim() != 2:
        return False
    part = trim_generated(out[rows], mask[rows], job.eos)
    return part.shape[1] + _lead(mask[rows]) < out.shape[1]


def _lead(mask):
    """Left-padding columns common to every row of `mask`."""
    return int((mask.cumsum(1) == 0).sum(1).min()) if mask.numel() else 0


# -- the failure policy ------------------------------------------------------------------------


class Runner:
    """Runs batches on one model with the failure policy (see the module docstring).

    `size` is the current batch size: it shrinks after an out-of-memory error.
    """

    def __init__(self, model, job, size):
        self.model = model
        self.job = job
        # A body with `with loss.backward():` runs alone: each item's backward pass would
        # free the batch's graph that the other items' backward passes still need.
        self.size = 1 if job.backward else size
        self.engine = engine_of(model)
        self.lowered = False  # the batch size was lowered to 1 after a batch-only model error

    def run_window(self, entries, done):
        """Run `entries` (in item order, any keys) in batches; `done(entry, saved)` for each.

        On an error raised for item k, first runs the entries before k that are not done.
        """
        pending = list(entries)
        while pending:
            # Planned once per size: a failure that lowers the size plans the rest again (the
            # batches of one plan are those that planning what is left would give first).
            size = self.size
            batches = plan_batches(pending, size)
            for i, batch in enumerate(batches):
                try:
                    self.run(batch, done)
                except Exception as error:
                    failed = item_of(error)
                    rest = [e for e in entries if failed is not None and e.index < failed
                            and not done.has(e.index)]
                    if rest:
                        self.run_window(rest, done)
                    raise
                if self.size != size:
                    pending = [e for later in batches[i + 1:] for e in later]
                    pending.sort(key=_in_item_order)
                    break
            else:
                pending = []

    def run(self, entries, done):
        """Run one batch (one key) with the retry and attribution policy."""
        ran_alone = self.engine.ran_alone
        try:
            saved = run_batch(self.model, self.job, entries)
        except torch.OutOfMemoryError as error:
            if len(entries) == 1:
                name_item(error, entries[0].index, entries[0].item)
                raise
            _free_memory()
            half = len(entries) // 2
            self.size = max(1, min(self.size, half))
            self.run(entries[:half], done)
            self.run(entries[half:], done)
            return
        except BatchingError:
            raise  # the inputs cannot be batched at all (a sequence-first model, batch_dim)
        except Exception as error:
            if item_of(error) is not None:
                raise  # run_window finishes the items before it (in this batch and others)
            if len(entries) == 1:
                name_item(error, entries[0].index, entries[0].item)
                raise
            # The model raised without naming an item: run the items alone. If one raises
            # alone, that is its error; if none does, the model fails only when batched
            # (a shared one-row keyword, say): the rest of the sweep runs alone too.
            for entry in entries:
                self.run([entry], done)
            self.size = 1
            if not self.lowered:
                self.lowered = True
                warnings.warn(BatchingWarning(
                    f"the model raised when {len(entries)} items ran as one batch, and ran "
                    f"each of them alone ({type(error).__name__}: {str(error).rstrip('.')}). "
                    f"The rest of the "
                    f"sweep runs with batch_size=1 (its bodies ran again for these items: "
                    f"side effects repeat); fix the inputs that do not batch (a keyword with "
                    f"one row for the whole batch?) to batch again"
                ), stacklevel=2)
            return
        if self.engine.ran_alone != ran_alone:
            self.size = 1  # items read a value reduced over the batch: they run alone anyway
        done.many(entries, saved)


class InOrder:
    """Hands finished items to `commit(entries, values)` in item order (batches finish in
    any order): `self(entry, values)` for one item, `many(entries, values)` for a batch's.

    `skip(index)`: an item finished by an earlier run of the sweep (`save_to=`), not run again.
    """

    _SKIPPED = object()

    def __init__(self, commit, start=0):
        self.commit = commit
        self.next = start
        self.waiting = {}

    def __call__(self, entry, values):
        index = entry.index
        if index < self.next or index in self.waiting:
            return  # finished already (a retried batch): recorded once
        if index == self.next and not self.waiting:  # the common case: the next one, in order
            self.commit((entry,), (values,))
            self.next = index + 1
            return
        self.waiting[index] = (entry, compact(values))  # it may wait for several batches
        self._advance()

    def many(self, entries, values):
        """A batch's finished entries (in item order) and their values. The common case, a
        batch of the next items in a row with nothing waiting, is one `commit`."""
        first = entries[0].index if entries else None
        if first == self.next and not self.waiting and entries[-1].index - first == len(entries) - 1:
            self.commit(entries, values)
            self.next = first + len(entries)
            return
        for entry, saved in zip(entries, values):
            self(entry, saved)

    def skip(self, index):
        self.waiting[index] = self._SKIPPED
        self._advance()

    def _advance(self):
        while self.next in self.waiting:
            waiting = self.waiting.pop(self.next)
            if waiting is not self._SKIPPED:
                self.commit((waiting[0],), (waiting[1],))
            self.next += 1

    def has(self, index):
        return index < self.next or index in self.waiting


def _free_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the automatic batch size ---------------------------------------------------------------


def choose_batch_size(model, job, sample, n_items=None):
    """A batch size for `job` on `model`, from the sample entries' length and free memory.

    On a CPU, batches of about `_CPU_TOKENS` tokens: one thread's cost per row was lowest for
    batches of 1,000-2,000 tokens on GPT-2 shapes and rose again at 4,000. On an
    accelerator, as many rows as half the free memory holds by a rough per-token estimate,
    at most `_GPU_TOKENS` tokens; an underestimate is corrected by the out-of-memory split.
    """
    if job.backward:
        return 1  # see Runner
    length = max([_tokens(entry.key, entry.args) for entry in sample] or [1])
    if job.generate:
        kwargs = getattr(getattr(job.run, "inner", None), "kwargs", None) or {}
        length += int(kwargs.get("max_new_tokens") or 0)
    module = module_of(model)
    device = _device_of(module)
    if device.type in ("cpu", "meta"):
        size = _CPU_TOKENS // length
    else:
        size = min(_GPU_TOKENS // length, _rows_that_fit(module, device, length))
    size = max(1, min(size, _MAX_ITEMS))
    if n_items is not None:
        size = min(size, max(1, n_items))
    return size


def _tokens(key, args):
    """Tokens (or elements beyond the batch dimension) of one item's input, all rows."""
    value = args[0] if args else None
    rows = _rows(value)
    if key and key[0] == "tokens":
        return max(1, key[1]) * rows
    if isinstance(value, torch.Tensor) and value.dim() > 1:
        return max(1, value[0].numel() if value.dim() > 2 else value.shape[-1]) * rows
    return rows


def _rows(value):
    """How many batch rows (prompts) one input holds, roughly: enough to size a batch."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() > 1 else 1
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], int):
        return len(value)
    if hasattr(value, "get") and value.get("input_ids") is not None:
        return _rows(torch.as_tensor(value.get("input_ids")))
    return 1


def _device_of(module):
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _rows_that_fit(module, device, length):
    try:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    except Exception:  # noqa: BLE001 - no memory query: leave it to the OOM split
        free = None
    if not free:
        return _MAX_ITEMS
    config = getattr(module, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1024
    vocab = getattr(config, "vocab_size", None) or 0
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 16
    element = next(module.parameters()).element_size()
    # live activations of a few layers, the attention scores, fp32 logits
    per_token = element * 24 * hidden + 4 * heads * length + 8 * vocab
    return max(1, int(0.5 * free) // max(1, per_token * length))


def check_batch_size(batch_size):
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InterlaceError(
            f"batch_size must be a positive int (items per forward pass) or None to choose "
            f"one automatically, got {batch_size!r}"
        )
    return batch_size
