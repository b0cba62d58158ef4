"""What a module's forward computes from, as one value that compares equal while nothing changed.

A copy of the model made elsewhere (a Ray worker's replica, sweeps/executors/ray.py) is only
current while this value is: a Ray sweep re-ships the model when it changes, and a
`LanguageModel` loaded by name is rebuilt from that name only while it equals its value at
load. It covers, for every module of the tree: its class and identity, the training flag,
its hooks (every hook dict, by key and hook identity), parameters and buffers (identity,
version counter - an in-place edit bumps it - and data pointer: `.data = ...`), its children
(structure), and its other attributes - numbers, strings and the like by value, tensors as
parameters are, containers element by element, other objects (a config) by identity plus
their own attributes, a few levels deep. Functions and hooks count by identity: editing a
variable a hook's closure reads is not seen.

Cheap: a walk over `__dict__`s, no tensor data read: about 2 ms for GPT-2 small (164 modules).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["fingerprint"]

_BY_VALUE = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype,
                       torch.device, torch.memory_format, torch.layout})
_DEPTH = 4  # how deep containers and plain objects are followed (a config's nested dicts)


def fingerprint(root: torch.nn.Module) -> tuple:
    """One comparable value of what `root`'s forward computes from (see the module docstring)."""
    seen: set = set()  # plain objects (a config shared by every layer) summarised once
    out = []
    stack = [root]
    visited = set()
    while stack:
        module = stack.pop()
        if id(module) in visited:
            continue
        visited.add(id(module))
        state = module.__dict__
        out.append(type(module))
        out.append(id(module))
        for name, value in state.items():
            kind = type(value)
            if kind in _BY_VALUE or not value and (kind is OrderedDict or kind is dict
                                                    or kind is set):
                out.append(name)  # the common cases first: a flag, an empty hook dict
                out.append(value)
            else:
                out.append(name)
                out.append(_summary(value, seen, 0))
        children = state.get("_modules")
        if children:
            stack.extend(child for child in children.values() if child is not None)
    return tuple(out)


def _summary(value, seen, depth):
    kind = type(value)
    if kind in _BY_VALUE:
        return value
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, torch.nn.Module):
        return (kind, id(value))  # walked as a module of the tree (or, if not in it, by identity)
    if depth >= _DEPTH:
        return (kind, id(value))
    if kind is dict or isinstance(value, dict):
        return (kind, tuple([(k, _summary(v, seen, depth + 1)) for k, v in value.items()]))
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        if kind is set or kind is frozenset:
            value = sorted(value, key=repr)
        return (kind, tuple([_summary(v, seen, depth + 1) for v in value]))
    state = getattr(value, "__dict__", None)
    if state is None or callable(value) or isinstance(value, type):
        return (kind, id(value))  # functions, hooks, classes, C objects: by identity
    if id(value) in seen:
        return (kind, id(value))
    seen.add(id(value))
    return (kind, id(value), _summary(state, seen, depth + 1))


def _tensor(tensor):
    try:
        pointer = tensor.data_ptr()
    except RuntimeError:  # a tensor without storage (sparse, a wrapper subclass)
        pointer = None
    return (id(tensor), tensor._version, pointer)
