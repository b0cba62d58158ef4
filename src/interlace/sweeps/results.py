"""What a sweep keeps: each saved name's values, one slot per item, in item order.

`SweepResults` is a read-only mapping name -> list (the same lists the sweep binds in the
caller); an item that did not save a name has `None` in its slot. `to_pandas()` gives one row
per item with the item's fields as columns, which is what people plot (a saved name that is
also an item field gets the suffix `_saved`).

`compact` is why a saved value never pins its batch: a tensor the body saved that is a view
into a larger storage (an item's rows of a batched activation, `logits[:, -1]`) is copied to
its own storage when the item finishes (with `save_to=`, by the store, and only for the rows
it keeps past their batch: store.py). Values keep their device and dtype (move them in the
body, e.g. `.cpu()`, if you want them elsewhere).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping

import torch

from ..errors import InterlaceError
from ..intervention.outputs import rebuild


class SweepResults(Mapping):
    """name -> list of values in item order (None where an item did not save the name).

    `finished` lists the finished items themselves, in order: after Ctrl-C or an error, the
    items before the one that stopped the sweep.
    """

    def __init__(self):
        self._columns = {}
        self.finished = []

    def declare(self, names):
        """Columns for `names` from the start (the names the body saves, known from its source):
        bound after the sweep even when no item saved them, `[]` after zero items."""
        for name in names:
            self._columns.setdefault(name, [None] * len(self.finished))

    def add(self, item, values):
        """Record one finished item's saved values (items arrive in order)."""
        self.extend((item,), (values,))

    def extend(self, items, values):
        """Record finished items' saved values, `values[i]` for `items[i]` (in order): a
        batch's in one call."""
        columns = self._columns
        names = columns.keys()
        if all(map(operator.le, map(dict.keys, values), itertools.repeat(names))):
            # no item saved a new name (the common case): each column grows in one call
            for name, column in columns.items():
                column.extend(map(dict.get, values, itertools.repeat(name)))
            self.finished.extend(items)
            return
        n = len(self.finished)
        for saved in values:
            for name in saved:
                if name not in columns:
                    columns[name] = [None] * n
            for name, column in columns.items():
                column.append(saved.get(name))
            n += 1
        self.finished.extend(items)

    def __getitem__(self, name):
        try:
            return self._columns[name]
        except KeyError:
            saved = ", ".join(sorted(self._columns)) or "none"
            raise KeyError(
                f"no sweep item saved {name!r} (names saved: {saved}); mark a value with "
                f".save() in the body to keep it"
            ) from None

    def __iter__(self):
        return iter(self._columns)

    def __len__(self):
        return len(self._columns)

    def __repr__(self):
        names = ", ".join(self._columns)
        return f"<SweepResults: {len(self.finished)} item(s); saved: {names or 'nothing'}>"

    def to_pandas(self, item_names=None):
        """A pandas DataFrame: one row per finished item, item fields then saved names as columns.

        Item fields: a dict's keys, a namedtuple's or dataclass's fields, `item_names` for a
        plain tuple (default `item_0`, `item_1`, ...), else one `item` column. A saved name
        equal to an item field is the column `<name>_saved` (both are kept). One-element
        tensors become Python numbers; other values are kept as they are.
        """
        try:
            import pandas
        except ImportError:
            raise InterlaceError(
                "sweep.results.to_pandas() needs pandas, which is not installed: "
                "pip install pandas (the mapping sweep.results works without it)"
            ) from None
        rows = []
        for position, item in enumerate(self.finished):
            row = item_fields(item, item_names)
            fields = tuple(row)
            for name, column in self._columns.items():
                row[_column_name(name, fields, self._columns)] = _cell(column[position])
            rows.append(row)
        columns = list(rows[0]) if rows else list(self._columns)
        return pandas.DataFrame(rows, columns=columns)


SAVED_SUFFIX = "_saved"


def _column_name(name, fields, saved):
    """A saved name's column: `name`, or `name + SAVED_SUFFIX` when an item field has that name."""
    if name not in fields:
        return name
    column = name + SAVED_SUFFIX
    if column in fields or column in saved:
        raise InterlaceError(
            f"to_pandas(): the saved name {name!r} is also an item field, and {column!r}, "
            f"where it would go instead, is taken too; rename the variable in the sweep body"
        )
    return column


def item_fields(item, names=None):
    """An item's fields as columns: name -> value (see `to_pandas`)."""
    if type(item) in _PLAIN:  # the usual one-field items first (with save_to=, once per item)
        return {str(names[0]) if names else "item": _cell(item)}
    if isinstance(item, Mapping):
        return {str(k): _cell(v) for k, v in item.items()}
    if hasattr(item, "_fields"):
        return {f: _cell(v) for f, v in zip(item._fields, item)}
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return {f.name: _cell(getattr(item, f.name)) for f in dataclasses.fields(item)}
    if isinstance(item, (tuple, list)):
        if names is not None:
            if len(names) != len(item):
                raise InterlaceError(
                    f"item_names has {len(names)} name(s) but item {item!r} has {len(item)} "
                    f"field(s); give one name per field"
                )
            return {str(n): _cell(v) for n, v in zip(names, item)}
        return {f"item_{i}": _cell(v) for i, v in enumerate(item)}
    return {str(names[0]) if names else "item": _cell(item)}


_PLAIN = (torch.Tensor, int, float, str, bool)
_Tensor = torch.Tensor
_BASE = operator.attrgetter("_base")


def _cell(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def compact(value):
    """`value` with every tensor that is a view into a larger storage copied to its own.

    Looks into lists, tuples and dicts (and dict-like model outputs); returns new containers
    only where something was copied.
    """
    if type(value) is dict and len(value) < 4096:  # (every item's saved names: one pass)
        out = None
        for k, v in value.items():
            if type(v) is _Tensor:  # the common case, without a call
                c = v.clone() if v._base is not None and _pins_more(v) else v
            else:
                c = compact(v)
            if c is not v:
                if out is None:
                    out = dict(value)
                out[k] = c
        return value if out is None else out
    if isinstance(value, torch.Tensor):
        if value._base is not None and _pins_more(value):  # only a view can hold more
            return value.clone()
        return value
    if type(value) in (list, tuple) and len(value) < 4096:
        out = [compact(v) for v in value]
        if all(a is b for a, b in zip(out, value)):
            return value
        return out if type(value) is list else tuple(out)
    if isinstance(value, Mapping) and hasattr(value, "to_tuple"):  # transformers' ModelOutput
        out = {k: compact(v) for k, v in value.items()}
        if all(out[k] is value[k] for k in out):
            return value
        rebuilt = rebuild(value, out)
        return rebuilt if type(rebuilt) is type(value) else value  # (one it cannot rebuild: whole)
    return value


def compact_all(rows):
    """`compact` each of a batch's saved dicts in `rows`, in place: one pass over the batch,
    where a value that is not a view (the common case) costs no call."""
    every = list(itertools.chain.from_iterable(map(dict.values, rows)))
    if all(map(operator.is_, map(type, every), itertools.repeat(_Tensor))) and all(
            map(operator.is_, map(_BASE, every), itertools.repeat(None))):
        return  # no view among them (the common case): looked at without a step per item
    tensor = _Tensor
    for i, values in enumerate(rows):
        for v in values.values():
            if type(v) is not tensor or v._base is not None:
                rows[i] = compact(values)
                break


def to_cpu(value):
    """`value` with every tensor on an accelerator copied to the CPU (lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else value.cpu()
    if type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    return value


def _pins_more(tensor):
    """Does `tensor` keep alive more memory than its own elements?"""
    if tensor.is_sparse or tensor.layout != torch.strided:
        return False
    try:
        held = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return False
    return held > tensor.numel() * tensor.element_size()
