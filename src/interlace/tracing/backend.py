"""Backend: what runs a captured body once the caller's frame has skipped it.

The default hands the body's code to the tracer's `execute` step, which runs it against a copy
of the caller's locals and pushes the result back. An interleaving backend
(interlace.intervention) runs `tracer.run_body()` inside a mediator, concurrently with a
model's forward pass, then calls `tracer.push_result(...)` itself.
"""

from __future__ import annotations


class Backend:
    """Run the body now, in this thread, and push its result back into the caller."""

    def __call__(self, tracer) -> None:
        if tracer._own_execute:
            tracer.execute(tracer.body_code())
        else:  # what the default `execute(body_code())` does, reading the caller's locals once
            tracer.push_result(tracer.run_body())  # (and the old execute shape's route)

    def __repr__(self):
        return f"{type(self).__name__}()"
