"""Batching several invokes into one forward pass, and giving each invoke only its rows.

`Batcher` is the batching strategy a model wrapper gives its engine (LanguageModel's
tokenizes and pads; see `engine.Engine`):

- `prepare(args, kwargs)` -> `Prepared`: one invoke's inputs, normalised, with its row count;
- `batch(prepared_list)` -> `(args, kwargs)`: the inputs of the single forward pass;
- `slices(prepared_list)` -> one `slice` of batch rows per invoke;
- `repeated(prepared, n)` -> `(args, kwargs, slices)`: the same for `n` invokes of the very
  same inputs (a sweep's shared input), without a step per invoke;
- `for_run(run)` -> the batcher for a run made by `run` (a generation may batch differently);
- `as_given`: a single invoke's inputs go to the model exactly as given (no `prepare`).

`narrow` / `swap` move values between the whole batch and one invoke's rows. Not every
value carries the batch, or carries it at dim 0: `axis_of` finds each tensor's batch axis
from what a probe run of one item alone saw (`probe.py`): a value the whole batch shares is
served whole (an item that edits it gets its own copy: `expand`), a value reduced over the
batch raises `RunAlone` (the engine then runs the items alone). A transformers `Cache` (a
model's returned key/value cache) is not a tuple of tensors but an object: an item gets a copy
of it holding its rows (`_narrow_cache`), and handing that copy back keeps the model's own
(`_swap_cache`). docs/batching.md is the rule.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections import namedtuple

import torch

from ..errors import BatchingError  # re-exported: its home is interlace.errors
from .outputs import rebuild


class Prepared(namedtuple("Prepared", ("args", "kwargs", "rows"))):
    """One invoke's inputs as the model will take them (`args`, `kwargs`), and how many batch
    rows they make (`rows`).

    A named tuple: `Batcher.prepare` makes one per invoke (per sweep item) with one C call,
    `_prepared(Prepared, (args, kwargs, rows))`, where a class with an `__init__` costs a
    Python frame. A batcher may keep more on it (LanguageModel's: the tokenized prompt)."""


_prepared = tuple.__new__


def rows_of(value, dim=0):
    """How many batch rows `value` (an input, possibly nested) holds along `dim`, or None."""
    if isinstance(value, torch.Tensor):
        return value.shape[dim] if value.dim() > dim else None
    if isinstance(value, (list, tuple)):
        for item in value:
            n = rows_of(item, dim)
            if n is not None:
                return n
    if isinstance(value, dict):
        for item in value.values():
            n = rows_of(item, dim)
            if n is not None:
                return n
    return None


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:80]


class Batcher:
    """Default batching: concatenate tensor arguments along `dim` (the inputs' batch
    dimension, `Model(batch_dim=)`); other arguments must agree."""

    as_given = True  # one invoke: its inputs as they are (the common trace costs nothing here)
    dim = 0
    batch_first = False  # True: the inputs are batch-first whatever the model's modules say

    def __init__(self, dim=0):
        self.dim = dim

    def for_run(self, run):
        """The batcher for a run whose model call is `run` (None: the module itself)."""
        return self

    def prepare(self, args, kwargs):
        dim = self.dim
        if dim:
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor) and value.dim() <= dim:
                    raise BatchingError(
                        f"batch_dim={dim}, but an input is {_describe(value)}, which has no dim "
                        f"{dim}: batch_dim names the inputs' batch dimension (interlace.Model("
                        f"module, batch_dim=...)); pass inputs that have it"
                    )
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dim() > dim:  # the common case: rows_of's answer
            return _prepared(Prepared, (tuple(args), dict(kwargs), first.shape[dim]))
        rows = rows_of(args, self.dim)
        if rows is None:
            rows = rows_of(kwargs, self.dim)
        return _prepared(Prepared, (tuple(args), dict(kwargs), rows if rows is not None else 1))

    def batch(self, prepared):
        if len(prepared) == 1:
            return prepared[0].args, prepared[0].kwargs
        first = prepared[0]
        n_args, names = len(first.args), first.kwargs.keys()
        for i, p in enumerate(prepared[1:], 1):
            kwargs = p.kwargs
            if len(p.args) != n_args or len(kwargs) != len(names) or (
                    names and kwargs.keys() != names):
                raise BatchingError(
                    f"cannot batch invokes: invoke 0 passes {len(first.args)} positional "
                    f"argument(s) and keywords {sorted(first.kwargs)}, invoke {i} passes "
                    f"{len(p.args)} and {sorted(p.kwargs)}; give every invoke the same arguments"
                )
        args = tuple(
            self._combine([p.args[j] for p in prepared], f"positional argument {j}")
            for j in range(len(first.args))
        )
        kwargs = {
            name: self._combine([p.kwargs[name] for p in prepared], f"keyword argument {name!r}")
            for name in first.kwargs
        }
        return args, kwargs

    def repeated(self, prepared, n):
        """`(args, kwargs, slices)` of `n` invokes that all pass the inputs `prepared`: what
        `batch` and `slices` give for `[prepared] * n`, with one op per tensor argument."""
        args = tuple(self._repeat(value, n, f"positional argument {j}")
                     for j, value in enumerate(prepared.args))
        kwargs = {name: self._repeat(value, n, f"keyword argument {name!r}")
                  for name, value in prepared.kwargs.items()}
        return args, kwargs, _even_slices(prepared.rows, n)

    def _repeat(self, value, n, what):
        if isinstance(value, torch.Tensor):
            return self._combine([value] * n, what)
        return value

    def slices(self, prepared):
        return rows_slices(map(_ROWS, prepared))

    def batch_invokes(self, invokes):
        """`(args, kwargs, slices)` of several invokes' `(fn, args, kwargs)` in one step, or
        None: take `prepare`, `batch` and `slices` (the default). A batcher whose common
        invokes need no step each may answer here; it must give what those three would."""
        return None

    def _combine(self, values, what):
        first = values[0]
        dim = self.dim
        if isinstance(first, torch.Tensor):
            # every value `first` (a shared input: every sweep item's tensor): one op, no
            # step per value
            if first.dim() > dim and all(map(operator.is_, values, itertools.repeat(first))):
                if first.is_contiguous():
                    repeats = [1] * first.dim()
                    repeats[dim] = len(values)
                    return first.repeat(repeats)
                return torch.cat(values, dim=dim)
            rest = first.shape[:dim] + first.shape[dim + 1:]
            for i, value in enumerate(values):
                if not isinstance(value, torch.Tensor) or value.dim() <= dim or (
                    value.shape[:dim] + value.shape[dim + 1:] != rest
                ):
                    where = "the first" if dim == 0 else f"the batch dimension ({dim})"
                    raise BatchingError(
                        f"cannot batch invokes: {what} is {_describe(first)} in invoke 0 but "
                        f"{_describe(value)} in invoke {i}; batched inputs must agree in every "
                        f"dimension but {where} (pad them, or run separate traces)"
                    )
            return torch.cat(values, dim=dim)
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor) or not _same(value, first):
                raise BatchingError(
                    f"cannot batch invokes: {what} is {_describe(first)} in invoke 0 but "
                    f"{_describe(value)} in invoke {i}; non-tensor arguments must be equal "
                    f"across invokes"
                )
        return first


_ROWS = operator.attrgetter("rows")


def rows_slices(counts):
    """One slice per count of rows, consecutive from 0 (no Python step per count)."""
    ends = list(itertools.accumulate(counts))
    return list(map(slice, itertools.chain((0,), ends), ends))


_SLICES = {}


def _even_slices(rows, n):
    """`n` slices of `rows` rows each, in order (shared lists: read them, do not change them)."""
    out = _SLICES.get((rows, n))
    if out is None:
        if len(_SLICES) > 256:
            _SLICES.clear()
        out = _SLICES[rows, n] = [slice(i * rows, (i + 1) * rows) for i in range(n)]
    return out


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are not the same
        return a is b


# -- one item's part of a batched value -------------------------------------------------------

SHARED = -1  # no batch axis, the same for every item (a position embedding of arange)
REDUCED = -2  # no batch axis, computed from every item (a loss, a .mean() over the batch)
_ORIGIN = "_interlace_batch_origin"


class RunAlone(BaseException):
    """Body side: an item asked for a value it cannot have in this batch (reduced over the
    batch, or a shared value replaced by one of another shape); the engine runs the items
    alone instead (`Engine.interleave`). A BaseException: a body's `except Exception` must
    not swallow it."""

    def __init__(self, key, why):
        super().__init__(key, why)
        self.key = key  # the location (set by the interleaver)
        self.why = why
        self.label = None  # "invoke 1", "sweep item"...: the body that asked
        self.where = None  # (filename, lineno) of the body's line


def axis_of(tensor, signature, total, dim):
    """Where `tensor` (a leaf of a batched value) carries the batch: an axis, SHARED, REDUCED,
    or `("squeeze", axis)` for a shared value that copy-on-edit gave a new batch axis.

    `signature` is what the model's first batched run learned of this leaf (`axes.py`):
    `(shape, computed from the inputs, batch total, batch axis)`, or None; without one, the axis is
    `dim` when its size is the batch total (else SHARED).
    """
    shape = tensor.shape
    rank = len(shape)
    if signature is None:
        return dim if rank > dim and shape[dim] == total else SHARED
    learned, from_inputs, learned_total, learned_axis = signature
    if from_inputs:
        if learned_axis is not None and learned_axis < rank and shape[learned_axis] == total:
            return learned_axis
        same_rank = rank == len(learned)
        found = [a for a in range(rank)
                 if shape[a] == total and (not same_rank or learned[a] == learned_total)]
        if found:
            return dim if dim in found else found[0]
        return REDUCED
    # shared by the batch, unless an item's edit gave it a batch axis (`expand`)
    if rank > dim and shape[dim] == total and total > 1:
        if rank == len(learned) and learned[dim] == 1:
            return dim
        if rank == len(learned) + 1:
            return ("squeeze", dim)
    return SHARED


def map_leaves(value, fn, objects=None):
    """`value` with each tensor leaf `t` replaced by `fn(i, t)` (`i` counts leaves in order);
    tuples, named tuples, lists and dicts (ModelOutputs too) are rebuilt around them. Any
    other object is kept, or replaced by `objects(obj)` when given (a transformers cache's
    narrowed copy: its tensors are not counted as leaves)."""
    counter = [0]

    def walk(v):
        if isinstance(v, torch.Tensor):
            i = counter[0]
            counter[0] = i + 1
            return fn(i, v)
        if isinstance(v, tuple):
            items = [walk(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            out = {k: walk(x) for k, x in v.items()}
            return out if type(v) is dict else rebuild(v, out)
        return v if objects is None else objects(v)

    return walk(value)


# -- a transformers cache object (`Cache`): its tensors, narrowed --------------------------

def is_cache(value):
    """True for a transformers `Cache` object (a model's returned key/value cache); never
    while transformers' caches are not loaded (no value can be one)."""
    cls = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return cls is not None and isinstance(value, cls)


def _holds_cache_state(value):
    """A cache's own part (a layer object, a nested cache) that is copied with its rows: an
    object of a transformers class with a `__dict__`."""
    return getattr(type(value), "__module__", "").startswith("transformers") and hasattr(
        value, "__dict__")


def _narrow_cache(cache, rows, total, mark):
    """A shallow copy of `cache` (a transformers `Cache`, of its own class) holding `rows` of
    each of its layers' tensors: every tensor of two dims or more whose first dim is the batch
    total narrowed to `rows` (a view: transformers' caches are batch-first), anything else
    shared.

    Each list it holds (its layers; older transformers kept lists of key and value tensors)
    becomes a `_Rows` list, which copies and narrows its items when first used: reading
    `model.output` must not pay two views per layer when the body reads only the logits. (A
    lone trace's cache is the model's own, live object; this one is the item's rows of it as
    of that first use.)"""
    out = object.__new__(type(cache))
    state = dict(cache.__dict__)
    for name, item in state.items():
        if type(item) is list:
            state[name] = _Rows(item, rows, total, mark)
        elif is_cache(item):  # (an encoder-decoder cache's two)
            state[name] = _narrow_cache(item, rows, total, mark)
    out.__dict__.update(state)
    return out


def _batch_first(item, total):
    return isinstance(item, torch.Tensor) and item.dim() > 1 and item.shape[0] == total


class _Rows(list):
    """A list that a cache holds (`source`) as one item's rows, filled when first used (any
    list operation): a layer becomes a shallow copy whose batch-first tensors are views of
    the item's rows, a batch-first tensor such a view, anything else is kept. For `swap`,
    `handed` then lists `(copy, original layer, {attribute: view})` and `views` maps an index
    to the view put there. Pickled or copied, it is a plain list."""

    __slots__ = ("source", "pending", "handed", "views")

    def __init__(self, source, rows, total, mark):
        super().__init__()
        self.source = source
        self.pending = (rows, total, mark)
        self.handed = []
        self.views = {}

    def _fill(self):
        rows, total, mark = self.pending
        self.pending = None
        copies = {}  # id(layer) -> its copy (a layer listed twice is copied once)
        filled = []
        for i, item in enumerate(self.source):
            if _holds_cache_state(item):
                new = copies.get(id(item))
                if new is None:
                    new = copies[id(item)] = object.__new__(type(item))
                    state, views = dict(item.__dict__), {}
                    for name, value in state.items():
                        if _batch_first(value, total):
                            state[name] = views[name] = _narrow_leaf(value, 0, rows, mark)
                    new.__dict__.update(state)
                    self.handed.append((new, item, views))
                item = new
            elif _batch_first(item, total):
                item = self.views[i] = _narrow_leaf(item, 0, rows, mark)
            filled.append(item)
        list.extend(self, filled)

    def write_back(self, rows, total):
        """What the body replaced in this filled list goes into the batch's rows."""
        if self.pending is not None:
            return  # never used: nothing replaced
        source = self.source
        if list.__len__(self) != len(source):
            raise BatchingError(
                "cannot write an item's cache back into the batch's: the item added or removed "
                "layers; run that item in a trace of its own")
        for copy, original, views in self.handed:
            _write_rows(copy.__dict__, original.__dict__, views, rows, total)
        _write_rows(dict(enumerate(self)), source, self.views, rows, total)

    def __reduce_ex__(self, protocol):
        if self.pending is not None:
            self._fill()
        return list, (list(list.__iter__(self)),)


def _filling(name):
    method = getattr(list, name)

    def filled_first(self, *args, **kwargs):
        if self.pending is not None:
            self._fill()
        return method(self, *args, **kwargs)

    filled_first.__name__ = name
    return filled_first


for _name in ("__getitem__", "__setitem__", "__delitem__", "__iter__", "__reversed__",
              "__len__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
              "__ge__", "__add__", "__iadd__", "__mul__", "__rmul__", "__imul__", "__repr__",
              "append", "extend", "insert", "pop", "remove", "clear", "copy", "count",
              "index", "reverse", "sort"):
    setattr(_Rows, _name, _filling(_name))


def _swap_cache(full, part, rows, total):
    """`swap` for a transformers cache: `full`, the batch's, with `part` as the item's rows.

    `part` is the copy that `narrow` handed out (edits of its views in place have reached
    `full` already): a tensor the body replaced in it has its rows written into `full`'s,
    and `full` itself is returned (the cache is the model's, which goes on updating it).
    Another cache object can stand in for the whole batch only."""
    if not _copied_from(part, full):
        if rows.start == 0 and rows.stop == total:
            return part
        raise BatchingError(
            f"cannot assign a {type(part).__name__} other than the one the item read as the "
            f"rows {rows.start}:{rows.stop} of the batch's cache; edit the cache the item "
            f"read (its tensors are the item's rows), or run that item in a trace of its own"
        )
    _write_back(part, full, rows, total)
    return full


def _copied_from(part, full):
    """True when `part` is `_narrow_cache`'s copy of `full` (the body may have replaced
    tensors in its lists and layers, not the lists themselves)."""
    mine, batch = part.__dict__, full.__dict__
    if mine.keys() != batch.keys():
        return False
    for name, item in mine.items():
        was = batch[name]
        if item is was:
            continue
        if type(item) is _Rows:
            if item.source is not was:
                return False
        elif not (is_cache(item) and is_cache(was) and _copied_from(item, was)):
            return False
    return True


def _write_back(part, full, rows, total):
    for name, item in part.__dict__.items():
        if type(item) is _Rows:
            item.write_back(rows, total)
        elif is_cache(item) and item is not full.__dict__[name]:
            _write_back(item, full.__dict__[name], rows, total)


def _write_rows(now, batch, views, rows, total):
    """Each tensor of `views` ({key: the view handed out}) that the body replaced in `now`
    (a mapping: a copy's fields, a list's items by index) goes into the rows of `batch`'s
    (the same keys: the original's fields, or the batch's list)."""
    for key, view in views.items():
        value = now.get(key)
        if value is view:
            continue
        whole = batch[key]
        if not _batch_first(whole, total):
            raise BatchingError(
                f"cannot write an item's {key!r} into the batch's cache: it no longer has one "
                f"row per item; run that item in a trace of its own")
        batch[key] = swap(whole, value, rows, total)


def leaf(value, index):
    """The `index`-th tensor leaf of `value` (in `map_leaves` order), or None."""
    found = []

    def pick(i, t):
        if i == index:
            found.append(t)
        return t

    map_leaves(value, pick)
    return found[0] if found else None


def _rows_index(axis, rows):
    return rows if axis == 0 else (slice(None),) * axis + (rows,)


def _narrow_leaf(tensor, axis, rows, mark=True):
    if axis == 0:  # the common case first
        part = tensor[rows]
        if mark:
            setattr(part, _ORIGIN, (tensor, rows))
        return part
    if type(axis) is tuple:
        axis = axis[1]
        part = tensor.narrow(axis, rows.start, 1).squeeze(axis)
    else:
        part = tensor[_rows_index(axis, rows)]
    if mark:
        setattr(part, _ORIGIN, (tensor, _rows_index(axis, rows)))
    return part


def narrow(value, rows, total, layout=None, dim=0, shared=None, axes=None, key=None,
           mark=True):
    """The part of `value` that belongs to batch rows `rows` (views where possible).

    `layout` is the probe's signatures of this location's leaves (see `axis_of`; None: the
    size rule). A leaf the whole batch shares is served whole or, when `shared` is a list,
    as a copy of its own, recorded there as `(leaf index, original, copy, copy's version)`
    so that an in-place edit of the copy can be made that item's alone (`expand`). A leaf
    reduced over the batch raises `RunAlone(None, ...)`. A narrowed tensor remembers
    `(batch tensor, index)`: the backward pass reaches the batch tensor, not this view of
    it, so `.grad` hooks go on the batch tensor (see `origin`). `axes`: a dict the caller
    keeps for one run whose layouts are fixed, caching a tensor's axis by `(key, shape)` (the
    items of a batch narrow the same value: `axis_of` once per location, not per item).
    `mark=False`: no `origin` on the parts (a run without `with loss.backward():` never asks;
    setting an attribute on a tensor costs about as much as the view).
    """

    if isinstance(value, torch.Tensor):  # the common case, without the walk
        if axes is None:
            axis = axis_of(value, layout[0] if layout else None, total, dim)
        else:
            cached = (key, value.shape)
            axis = axes.get(cached)
            if axis is None:
                axis = axes[cached] = axis_of(value, layout[0] if layout else None, total, dim)
        if axis == 0 or (type(axis) is int and axis > 0):
            return _narrow_leaf(value, axis, rows, mark)

    def part(i, tensor):
        axis = axis_of(tensor, layout[i] if layout is not None and i < len(layout) else None,
                       total, dim)
        if axis == SHARED:
            if shared is None:
                return tensor
            copy = tensor.clone()
            shared.append((i, tensor, copy, copy._version))
            return copy
        if axis == REDUCED:
            raise RunAlone(None, f"reduced over the batch (shape {tuple(tensor.shape)}: no "
                                 f"batch dimension, but computed from every item)")
        return _narrow_leaf(tensor, axis, rows, mark)

    def cache(obj):
        return _narrow_cache(obj, rows, total, mark) if is_cache(obj) else obj

    return map_leaves(value, part, cache)


def origin(tensor):
    """`(batch tensor, index)` when `tensor` is one invoke's rows of a batched value, else None."""
    return getattr(tensor, _ORIGIN, None)


def expand(full, rows, part, total, dim):
    """Copy on edit: `full`, a value the whole batch shares, given a batch axis at `dim` (its
    size-1 dim there, else a new one) with the rows `rows` set to `part` (the item's edit)
    and every other row the original. Raises RunAlone when `part` does not fit."""
    base = full if full.dim() > dim and full.shape[dim] == 1 else full.unsqueeze(dim)
    shape = list(base.shape)
    shape[dim] = total
    out = base.expand(shape).clone(memory_format=torch.contiguous_format)
    put(out, rows, part, dim)
    return out


def put(batched, rows, part, dim):
    """Write `part` (one item's value, with or without the size-1 batch dim) into `rows`."""
    target = batched.narrow(dim, rows.start, rows.stop - rows.start)
    if not isinstance(part, torch.Tensor):
        raise RunAlone(None, f"replaced by a {type(part).__name__}")
    try:
        target.copy_(part if part.dim() == target.dim() else part.unsqueeze(dim))
    except RuntimeError:
        raise RunAlone(None, f"replaced by a tensor of shape {tuple(part.shape)} where the batch "
                             f"shares one of shape {tuple(target.shape[:dim] + target.shape[dim + 1:])}") from None


def swap(full, part, rows, total, layout=None, dim=0, expanded=None):
    """`full` with batch rows `rows` replaced by `part` (the whole of `full` stays intact).

    A leaf the batch shares gets a batch axis of its own, the other rows keeping the
    original (`expand`; its index is appended to `expanded`); a leaf reduced over the batch
    raises `RunAlone`.
    """
    counter = [0]

    def walk(f, p):
        if isinstance(f, torch.Tensor):
            i = counter[0]
            counter[0] = i + 1
            axis = axis_of(f, layout[i] if layout is not None and i < len(layout) else None,
                           total, dim)
            if axis == SHARED:
                if expanded is not None:
                    expanded.append(i)
                return expand(f, rows, p, total, dim)
            if axis == REDUCED:
                raise RunAlone(None, "reduced over the batch, and assigned")
            if not isinstance(p, torch.Tensor):
                raise BatchingError(
                    f"cannot assign {type(p).__name__} to the rows of a batched tensor of shape "
                    f"{tuple(f.shape)}; assign a tensor with {rows.stop - rows.start} row(s)"
                )
            if type(axis) is tuple:
                axis = axis[1]
                p = p.unsqueeze(axis)
            pieces = [f.narrow(axis, 0, rows.start), p,
                      f.narrow(axis, rows.stop, f.shape[axis] - rows.stop)]
            return torch.cat([x for x in pieces if x.shape[axis]], dim=axis)
        if isinstance(f, (tuple, list)) and isinstance(p, (tuple, list)) and len(f) == len(p):
            items = [walk(a, b) for a, b in zip(f, p)]
            if isinstance(f, tuple):
                return type(f)(*items) if hasattr(f, "_fields") else tuple(items)
            return items
        if isinstance(f, dict) and isinstance(p, dict):
            out = {k: walk(f[k], v) if k in f else v for k, v in p.items()}
            return out if type(f) is dict else rebuild(f, out)
        if p is not f and is_cache(f) and is_cache(p):
            return _swap_cache(f, p, rows, total)
        return p

    return walk(full, part)
