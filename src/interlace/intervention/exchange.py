"""The event exchange: the model-side step that hands one value to the bodies waiting for it.

Every way a value reaches a body goes through it: module hooks and the run's result
(`hooks.py`, `interleaver.py`), locations inside a forward (`source.py`), and gradients
(`grads.py`). The step, for location `key` happening with `value`:

    count the occurrence -> take the bodies waiting for (key, occurrence) -> hand the value
    to each in invoke order, on its greenlet, under its own torch grad mode -> return what
    they left (a replacement, or nothing)

It is mechanism, so it lives in the hot path: `hotpath.Exchange` (compiled in
csrc/_chotpath.pyx, twin in _pyhotpath.py) does the whole step in one call from a torch hook,
and returns at once when nobody waits. The owner's policy is three callables it calls:
`routed(key, occ, value)` for locations that need more than the step (pending skips,
observers: `hooks.routed`), `message(mediator, message, event)` when a body comes back with
anything but "parked" (it ended, failed or stopped), and `paused(mediator, event)` after each
body while variables are shared between invokes or a barrier holds one. A body reads
`event.value` and may replace it (`event.value = v; event.replaced = True`); the next body
sees the replacement.

The interleaver is its own exchange (it subclasses it: `current`, `bypass`, `hub` are fields
the compiled hooks read directly); a gradient run holds one.
"""

from __future__ import annotations

from .._native import hotpath

Exchange = hotpath.Exchange
Event = hotpath.Event

__all__ = ["Exchange", "Event"]
