"""Which way a body runs: on a worker greenlet, or as a generator.

A body that waits for values runs beside the model. On a greenlet it can wait anywhere,
in any function it calls; as a generator (tracing/generators.py: each read is a `yield`)
it waits only in its own lines, with a `send` per wait instead of a switch pair (what that
saves, measured, and what it does not yet: docs/architecture.md, "Generator bodies"). The
route is chosen per call site, never by the user:

1. A site whose body capture cannot prove (`generators.refusal`: a read in a lambda or a
   comprehension, a `with` statement, `tracer.iter`, a barrier...) stays on greenlets.
2. Otherwise its first run is an audit (`AuditMediator`): the generator body driven on a
   greenlet, counting the waits that were not its own yields (a helper function it calls
   that reads). None: the site runs as a generator (`GeneratorMediator`) from then on.
   Some: it stays on greenlets.
3. A site running as a generator that meets a wait it cannot serve (the helper reads only
   on this run) raises an `InterlaceError` naming the line before the read has any effect,
   and the site is pinned to greenlets: that is the one observable difference.

`INTERLACE_GENERATORS=0` (read at import) forces every body onto greenlets: CI runs the
engine's suites that way too, so that both routes stay tested (measured, the route is within
a few µs of the greenlet route either way: docs/architecture.md, "Generator bodies"). Only jobs that
run a deferred body as it was bound (a trace's body, a sweep item's) can take the route; a
`Tracer` subclass whose `build` or `compile` step differs takes it only if it sets
`generator_bodies = True`. The verdict lives on the site's Block, in this process.
"""

from __future__ import annotations

import os

from ..errors import InterlaceError
from ..tracing.tracer import Tracer
from .mediator import AuditMediator, GeneratorMediator, Mediator

AUDIT = "audit"
GENERATOR = "generator"

ENABLED = os.environ.get("INTERLACE_GENERATORS", "") != "0"
"""False when INTERLACE_GENERATORS=0: every body then runs on a greenlet."""


def mediator_class(fn):
    """The Mediator class that runs job `fn` (see the module docstring). Its `route_block`:
    None (greenlets) or the Block of its body."""
    block = getattr(fn, "route_block", None)
    if block is None or not ENABLED:
        return Mediator
    route = block.route
    if route is GENERATOR:
        return GeneratorMediator
    if route is None:
        route = block.route = _first_route(block)
    if route is AUDIT:
        return AuditMediator
    return Mediator


def eligible(body):
    """`body`'s Block when this deferred body may run as a generator (it was bound as
    written, its tracer's steps allow it, the route is on), else None."""
    if not ENABLED or body.globals is None:
        return None
    cls = type(body.tracer)
    allowed = cls.__dict__.get("_generator_route")  # (decided once per class, kept on it)
    if allowed is None:
        allowed = cls.generator_bodies
        if allowed is None:
            allowed = not cls._old_steps and cls.build is Tracer.build and cls.compile is Tracer.compile
        allowed = bool(allowed)
        type.__setattr__(cls, "_generator_route", allowed)
    return body.block if allowed else None


def _first_route(block):
    from ..tracing.generators import refusal  # (capture loaded the parser already)

    if block.statements is None:
        return "its statements are not available (a Block rebuilt from a pickle)"
    reason = refusal(block.statements)
    return AUDIT if reason is None else reason


def audited(block, strays):
    """The audit run of `block`'s site ended: `strays` waits were not the body's own yields."""
    if block.route is AUDIT:
        block.route = GENERATOR if not strays else (
            f"a function the body calls waited for the model ({strays} time(s) in its audit run)"
        )


def stray(block, where):
    """A wait at `where` (file:line) that a generator body of `block` cannot serve: pin the
    site to greenlets and return the error to raise there."""
    block.route = f"{where}: a wait outside the body's own lines"
    return InterlaceError(
        f"{where}: this waits for the model (a read, a write, a barrier...) in code that the "
        f"body of the `with` block at {block.filename}:{block.lineno} calls, not in the "
        f"body's own lines. Its earlier runs read only in its own lines, so it runs as a "
        f"generator (each read a `yield`), which cannot wait inside a function it calls. "
        f"Nothing was read here. The block runs on greenlets from now on (which serve such "
        f"reads): run it again. With INTERLACE_GENERATORS=0 every body runs on greenlets."
    )
