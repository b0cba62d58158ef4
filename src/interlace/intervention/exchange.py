"""The event exchange: the model-side step that hands one value to the bodies waiting for it.

Every way a value reaches a body goes through it: module hooks and the run's result
(`hooks.py`, `interleaver.py`), locations inside a forward (`source.py`), and gradients
(`grads.py`). The step, for location `key` happening with `value`:

    count the occurrence -> take the bodies waiting for (key, occurrence) -> hand the value
    to each in invoke order -> return what they left (a replacement, or nothing)

Counting and the table of waiting bodies are the hot path's `Hub` (mechanism); what resuming
one body means - what its messages mean, publishing its variables to later invokes - is the
owner's `serve(mediator, event)` (policy). A body reads `event.value` and may replace it
(`event.value = v; event.replaced = True`); the next body sees the replacement.
"""

from __future__ import annotations


class Event:
    """One happening of a location, as handed to bodies: its value may be replaced."""

    __slots__ = ("key", "occ", "value", "replaced")

    def __init__(self, key, occ, value):
        self.key = key
        self.occ = occ
        self.value = value
        self.replaced = False


def _invoke_order(mediator):
    return mediator.index


class Exchange:
    """One run's exchange: `handoff(key, value)` is the whole model-side step of one event."""

    __slots__ = ("hub", "serve")

    def __init__(self, hub, serve):
        self.hub = hub  # hotpath.Hub: occurrence counters and the parked requests
        self.serve = serve  # serve(mediator, event): resume one waiting body with the event

    def handoff(self, key, value):
        """Location `key` happened with `value`: the `Event` as the waiting bodies left it
        (`event.replaced` says whether one assigned it), or None when nobody waited."""
        hub = self.hub
        occ = hub.fire(key)
        waiters = hub.take(key, occ)
        if waiters is None:
            return None
        event = Event(key, occ, value)
        if len(waiters) > 1:
            waiters.sort(key=_invoke_order)
        serve = self.serve
        for mediator in waiters:
            serve(mediator, event)
        return event

    def grow(self, nkeys, visits=None, positions=None):
        """Make room for keys up to `nkeys` (locations added during the run), counted exactly
        from now on; `visits`/`positions`: the learned order's, grown with them."""
        hub = self.hub
        missing = nkeys - len(hub.counts)
        if missing > 0:  # the hub indexes its tables unchecked: grow them before any fire
            hub.counts.extend([0] * missing)
            hub.exact.extend([True] * missing)
            if hub.visits is not None:
                hub.visits = visits
                hub.positions = positions
