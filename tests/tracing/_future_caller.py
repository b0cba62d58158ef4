"""A caller compiled with `from __future__ import annotations`: the body must be too."""

from __future__ import annotations

from interlace import save


def annotated(cm):
    with cm():

        def g(x: Undefined):  # noqa: F821 - only valid as a postponed annotation
            return x

        got = save(dict(g.__annotations__))
    return got
