"""Fixtures for the torch-free tracer tests.

The reference for "same observable result as running the block inline" is `Inline`: a
context manager that runs its body inline, inside a trace state of its own, so that
`save()` / `.save()` work there as they do in a traced body. A test writes its block once,
as a function of the context manager class, and compares `f(Tracer)` with `f(Inline)`.
"""

import pytest

from interlace.tracing.save import _CURRENT, TraceState, enter_body, exit_body


class Inline:
    """Reference: run the body inline, with `save` usable, pushing nothing anywhere."""

    def __init__(self, *args, backend=None, **kwargs):
        self.args = args
        self.kwargs = kwargs

    def __enter__(self):
        self._token = enter_body(TraceState(_CURRENT.get()))  # as Tracer.run_body: mounts .save()
        return self

    def __exit__(self, *exc):
        exit_body(self._token)
        return False


@pytest.fixture
def inline():
    return Inline
