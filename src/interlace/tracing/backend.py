"""Backend: what runs a captured body once the caller's frame has skipped it.

The default runs the body against a copy of the caller's locals and pushes the result back.
An interleaving backend (interlace.intervention) runs `tracer.run_body()` inside a mediator,
concurrently with a model's forward pass, then calls `tracer.push_result(...)` itself.
"""

from __future__ import annotations


class Backend:
    """Run the body now, in this thread, and push its result back into the caller."""

    def __call__(self, tracer) -> None:
        tracer.push_result(tracer.run_body())

    def __repr__(self):
        return f"{type(self).__name__}()"
