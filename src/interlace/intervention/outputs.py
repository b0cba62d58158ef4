"""A model's output rebuilt around other values: the same type, new leaves.

Narrowing a batched value to one invoke's rows (batching.py), writing an invoke's rows back,
and a cache's copies all rebuild the mappings they walk with the same keys and new values.
For a plain dict that is a dict. For transformers' `ModelOutput`s (a dataclass that is also
an `OrderedDict`), `type(value)(**items)` runs the dataclass's `__init__` and its checks
(`__post_init__`: the fields looked up, each set twice through Python `__setattr__`): about
13 us a value on a 2-core VM, paid by every invoke or sweep item that reads `model.output`.

`rebuild` makes the same object directly when the result is known to be the same:
- the class is a `ModelOutput` subclass with the `__init__` that `@dataclass` generates
  (transformers may wrap it to rename old keywords) and transformers' own `__post_init__`,
  `__setattr__` and `__setitem__`, and its fields after the first default to None;
- the new items are all fields, and either a field after the first is set or the first is
  a tensor (`__post_init__` reads a lone first field of another kind as an iterator of
  items).
Then `__init__` would have set every field as an attribute (None when not given) and
`__post_init__` each non-None field as an item, in field order: that is what is set here.
Anything else takes the constructor.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import OrderedDict

import torch

_FIELDS: dict = {}  # type -> (its fields in order, as a set) when `rebuild` may make it directly, else None
_SET_ITEM = OrderedDict.__setitem__


def rebuild(value, items: dict):
    """A mapping of `value`'s type with `items` (the keys of `value`, new values), as
    `type(value)(**items)` makes it; a plain dict when that constructor fails (an exotic
    mapping)."""
    cls = type(value)
    names = _FIELDS.get(cls, _FIELDS)
    if names is _FIELDS:
        names = _FIELDS[cls] = _direct_fields(cls)
    if names is not None and items.keys() <= names[1]:
        order = names[0]
        new = cls.__new__(cls)
        attributes = new.__dict__
        for name in order:  # every field an attribute, as `__init__` sets it
            attributes[name] = items.get(name)
        # (a tensor first, or a later field set: `__post_init__` reads no iterator of items)
        if isinstance(attributes[order[0]], torch.Tensor) or any(
                attributes[name] is not None for name in order[1:]):
            for name in order:  # the non-None ones items, in field order, as `__post_init__`
                item = attributes[name]
                if item is not None:
                    _SET_ITEM(new, name, item)
            return new
    try:
        return cls(**items)
    except Exception:  # noqa: BLE001 - an exotic mapping: a plain dict of the same items
        return items


def _direct_fields(cls):
    """`(field names in order, the same as a set)` when `rebuild` may make `cls` without its
    constructor (see the module docstring), else None."""
    generic = sys.modules.get("transformers.utils.generic")
    base = getattr(generic, "ModelOutput", None)
    if base is None or not issubclass(cls, base) or cls is base or not dataclasses.is_dataclass(cls):
        return None
    for name in ("__post_init__", "__setattr__", "__setitem__", "__new__"):
        if getattr(cls, name) is not getattr(base, name):
            return None
    init = cls.__init__
    init = getattr(init, "__wrapped__", init)  # (transformers' keyword renaming)
    if getattr(getattr(init, "__code__", None), "co_filename", None) != "<string>":
        return None  # an `__init__` of the class's own, not the one `@dataclass` wrote
    fields = dataclasses.fields(cls)
    if not fields or not all(f.init for f in fields) or any(f.default is not None for f in fields[1:]):
        return None
    names = tuple(f.name for f in fields)
    return names, frozenset(names)
