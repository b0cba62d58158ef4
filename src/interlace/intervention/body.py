"""BodyJob: the mediator's job for a captured body (a trace's, an invoke's, a backward's).

The body itself is the tracer core's `DeferredBody`; the job adds what interleaving needs:
the final locals land in `out` (read by the backend, and by later invokes through
`paused_values` and `out`), also when the body ends early (`tracer.stop()`, an `iter` loop
cut short), where they are the locals at the point the signal left it.
"""

from __future__ import annotations

from .mediator import ENDED_EARLY


class BodyJob:
    """Run `body` (a `DeferredBody`) once, by `run` (default: `body.run`); fill `out`."""

    __slots__ = ("body", "out", "assigns", "takes", "tracer", "_run")

    def __init__(self, body, out, run=None):
        self.body = body
        self.out = out  # the body's final locals (shared with later invokes when it ends)
        self.assigns = body.block.assigned_names
        # names it may take from earlier invokes (an invoke's `shadowed`); None: unknown
        self.takes = getattr(run, "shadowed", None)
        self.tracer = body.tracer
        self._run = body.run if run is None else run

    def __call__(self):
        try:
            self.out.update(self._run())
        except ENDED_EARLY as signal:
            self.out.update(self.body.locals_at(signal))
            raise

    def paused_values(self, frame):
        """The names this paused body has rebound since entry (see `DeferredBody.paused_values`)."""
        return self.body.paused_values(frame)

    def __repr__(self):
        return f"<BodyJob {self.body!r}>"
