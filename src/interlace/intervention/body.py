"""BodyJob: the mediator's job for a captured body (a trace's, an invoke's, a backward's).

The body itself is the tracer core's `DeferredBody`; the job adds what interleaving needs:
the final locals land in `out` (read by the backend, and by later invokes through
`paused_values` and `out`), also when the body ends early (`tracer.stop()`, an `iter` loop
cut short), where they are the locals at the point the signal left it.
"""

from __future__ import annotations

from .._native import hotpath
from ..tracing.block import GENERATOR_PARAMS, LOCALS_PARAM
from . import routes
from .mediator import ENDED_EARLY


class BodyJob:
    """Run `body` (a `DeferredBody`) once, by `run` (default: `body.run`); fill `out`.
    `takes`: the names it may take from earlier invokes (an invoke's `shadowed`, also read
    from `run` when that has them); None: unknown."""

    __slots__ = ("body", "out", "assigns", "takes", "tracer", "_run", "route_block")

    def __init__(self, body, out, run=None, takes=None):
        self.body = body
        self.out = out  # the body's final locals (shared with later invokes when it ends)
        self.assigns = body.block.assigned_names
        self.takes = getattr(run, "shadowed", takes)
        self.tracer = body.tracer
        self._run = body.run if run is None else run
        # the Block whose route decides how this job runs (routes.py); None: on a greenlet
        # (a body run by an invoke's own `run`, or not eligible)
        self.route_block = routes.eligible(body) if run is None else None

    # -- the generator route (routes.py) --------------------------------------------------

    def generator(self):
        """(the body as a generator, whose reads are its yields; the save state to run it
        in): `finish(values)`, `ended_early(signal)` or `failed(error)` follows, as
        `__call__` ends."""
        body = self.body
        return body.generator(), body.state  # (natively a C method for a warm site)

    def finish(self, values):
        self.out.update(self.body.generator_locals(values))

    def ended_early(self, signal):
        self.out.update(self.body.locals_at(signal))

    def failed(self, error):
        return error

    def audited(self, strays):
        routes.audited(self.body.block, strays)

    def stray_wait(self, where):
        return routes.stray(self.body.block, where)

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


# `generator()` and `finish(values)` as above, taken by the compiled extension itself (no
# Python frame per body) while BodyJob's own methods are these
hotpath.plain_job(BodyJob, (LOCALS_PARAM, *GENERATOR_PARAMS))
