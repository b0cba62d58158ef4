"""`interlace.Inputs(*args, **kwargs)`: one sweep item's forward arguments, when one value is not enough.

`model.sweep(items, input=...)` passes one value to the forward as its single positional
argument, so a plain tuple stays one argument (a model may take a tuple). A forward with
several positional arguments, or per-item keywords, gets them marked as such:

    with model.sweep(items, input=lambda item: interlace.Inputs(x[item], mask[item], scale=2)):

Each positional argument and keyword is batched across the items as invokes' are (tensors
concatenated on dim 0, other values equal across a batch); the item's keywords add to those
given to `model.sweep(...)`.
"""

from __future__ import annotations


class Inputs:
    """The positional arguments and keywords of one item's forward (see the module docstring)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs

    def __repr__(self):
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Inputs({', '.join(parts)})"

    def __reduce__(self):
        return (_rebuild, (self.args, self.kwargs))


def _rebuild(args, kwargs):
    return Inputs(*args, **kwargs)


def split(value, kwargs):
    """`(args, kwargs)` of the forward for an item whose input is `value`; `kwargs` are the
    sweep's own keywords (an item may not give one of them again)."""
    if not isinstance(value, Inputs):
        return (value,), kwargs
    if not value.kwargs:
        return value.args, kwargs
    again = sorted(set(value.kwargs) & set(kwargs))
    if again:
        raise TypeError(
            f"interlace.Inputs(...) gives {', '.join(again)}, which model.sweep(...) was given "
            f"too: pass each keyword in one place (per item in Inputs, or shared in model.sweep)"
        )
    return value.args, {**kwargs, **value.kwargs}
