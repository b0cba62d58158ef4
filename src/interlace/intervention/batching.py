"""Batching several invokes into one forward pass, and giving each invoke only its rows.

`Batcher` is the batching strategy a model wrapper gives its engine (LanguageModel's
tokenizes and pads; see `engine.Engine`):

- `prepare(args, kwargs)` -> `Prepared`: one invoke's inputs, normalised, with its row count;
- `batch(prepared_list)` -> `(args, kwargs)`: the inputs of the single forward pass;
- `slices(prepared_list)` -> one `slice` of batch rows per invoke;
- `for_run(run)` -> the batcher for a run made by `run` (a generation may batch differently);
- `as_given`: a single invoke's inputs go to the model exactly as given (no `prepare`).

`narrow` / `swap` move values between the whole batch and one invoke's rows: tensors whose
first dimension is the batch size are sliced (a view, so in-place edits reach the model);
everything else is shared whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InterlaceError


class BatchingError(InterlaceError, ValueError):
    """The inputs of several invokes cannot be combined into one batch."""


@dataclass
class Prepared:
    """One invoke's inputs as the model will take them, and how many batch rows they make."""

    args: tuple
    kwargs: dict
    rows: int


def _rows_of(value):
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    if isinstance(value, (list, tuple)):
        for item in value:
            n = _rows_of(item)
            if n is not None:
                return n
    if isinstance(value, dict):
        for item in value.values():
            n = _rows_of(item)
            if n is not None:
                return n
    return None


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:80]


class Batcher:
    """Default batching: concatenate tensor arguments on dim 0; other arguments must agree."""

    as_given = True  # one invoke: its inputs as they are (the common trace costs nothing here)

    def for_run(self, run):
        """The batcher for a run whose model call is `run` (None: the module itself)."""
        return self

    def prepare(self, args, kwargs):
        rows = _rows_of(args)
        if rows is None:
            rows = _rows_of(kwargs)
        return Prepared(tuple(args), dict(kwargs), rows if rows is not None else 1)

    def batch(self, prepared):
        if len(prepared) == 1:
            return prepared[0].args, prepared[0].kwargs
        first = prepared[0]
        for i, p in enumerate(prepared[1:], 1):
            if len(p.args) != len(first.args) or p.kwargs.keys() != first.kwargs.keys():
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

    def slices(self, prepared):
        out, start = [], 0
        for p in prepared:
            out.append(slice(start, start + p.rows))
            start += p.rows
        return out

    def _combine(self, values, what):
        first = values[0]
        if isinstance(first, torch.Tensor):
            for i, value in enumerate(values):
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or (
                    value.shape[1:] != first.shape[1:]
                ):
                    raise BatchingError(
                        f"cannot batch invokes: {what} is {_describe(first)} in invoke 0 but "
                        f"{_describe(value)} in invoke {i}; batched inputs must agree in every "
                        f"dimension but the first (pad them, or run separate traces)"
                    )
            return torch.cat(values, dim=0)
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor) or not _same(value, first):
                raise BatchingError(
                    f"cannot batch invokes: {what} is {_describe(first)} in invoke 0 but "
                    f"{_describe(value)} in invoke {i}; non-tensor arguments must be equal "
                    f"across invokes"
                )
        return first


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are not the same
        return a is b


_ORIGIN = "_interlace_batch_origin"


def narrow(value, rows, total):
    """The part of `value` that belongs to batch rows `rows` (views where possible).

    A narrowed tensor remembers `(batch tensor, rows)`: the backward pass reaches the batch
    tensor, not this view of it, so `.grad` hooks go on the batch tensor (see `origin`).
    """
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] == total:
            part = value[rows]
            setattr(part, _ORIGIN, (value, rows))
            return part
        return value
    if isinstance(value, tuple):
        items = [narrow(v, rows, total) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [narrow(v, rows, total) for v in value]
    if isinstance(value, dict):
        out = {k: narrow(v, rows, total) for k, v in value.items()}
        if type(value) is dict:
            return out
        try:
            return type(value)(**out)
        except Exception:  # noqa: BLE001 - exotic mapping: hand back a plain dict
            return out
    return value


def origin(tensor):
    """`(batch tensor, rows)` when `tensor` is one invoke's rows of a batched value, else None."""
    return getattr(tensor, _ORIGIN, None)


def swap(full, part, rows, total):
    """`full` with batch rows `rows` replaced by `part` (the whole of `full` stays intact)."""
    if isinstance(full, torch.Tensor):
        if not (full.dim() and full.shape[0] == total):
            return part
        if not isinstance(part, torch.Tensor):
            raise BatchingError(
                f"cannot assign {type(part).__name__} to the rows of a batched tensor of shape "
                f"{tuple(full.shape)}; assign a tensor with {rows.stop - rows.start} row(s)"
            )
        pieces = [full[: rows.start], part, full[rows.stop:]]
        return torch.cat([p for p in pieces if p.shape[0]], dim=0)
    if isinstance(full, (tuple, list)) and isinstance(part, (tuple, list)) and len(full) == len(part):
        items = [swap(f, p, rows, total) for f, p in zip(full, part)]
        if isinstance(full, tuple):
            return type(full)(*items) if hasattr(full, "_fields") else tuple(items)
        return items
    if isinstance(full, dict) and isinstance(part, dict):
        out = {k: swap(full[k], v, rows, total) if k in full else v for k, v in part.items()}
        if type(full) is dict:
            return out
        try:
            return type(full)(**out)
        except Exception:  # noqa: BLE001
            return out
    return part
