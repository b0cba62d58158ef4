"""Variables shared between the invokes of one run.

The rule (an invoke's body behaves as if it ran inline where its `with` stands): a name the
body reads but does not assign, which an EARLIER invoke's body assigns, is that earlier
body's value - the latest earlier invoke that assigns it wins, as inline. Bodies publish
their variables whenever they pause or end; a reader whose provider has not bound the name
yet waits for it (the model runs on meanwhile), and the run resumes it once it can go on.

A body takes part when its job (`mediator.fn`) has `assigns` (the names it binds), `out`
(its final locals, once it ended) and `paused_values(frame)` (the names it has rebound so
far, read from its paused stack); see `tracer._body`. Its optional `takes` (the names it
may take from earlier invokes) lets a run whose bodies take nothing skip sharing. A model's
edits have no `assigns`.

`Sharing` takes part in the run's control flow (`Interleaver.join`): it publishes a body's
variables when it pauses, lets a waiting reader go once its provider bound the name, and
ends the wait of readers whose provider never got there when the run is over.
"""

from __future__ import annotations

import itertools
import operator

from greenlet import getcurrent

from .mediator import PARKED, StopSignal

_FN = operator.attrgetter("fn")
_NOTHING = frozenset()
MISSING = object()  # no earlier invoke binds the name: the caller's value or a global applies
WAIT = object()  # the earlier invoke that binds it is still running and has not bound it yet


def shares(mediators):
    """Do these bodies need sharing: does a body that binds names come after another one,
    and may it take a name from an earlier one?

    A job's `takes` (the names an earlier invoke assigns that this one does not; None when
    unknown) rules sharing out when it is empty for every later body: then no body can see
    another's variables, and publishing them at every pause would be wasted work.
    """
    assigns = map(getattr, map(_FN, mediators), itertools.repeat("assigns"), itertools.repeat(None))
    if all(map(operator.is_, assigns, itertools.repeat(None))):
        return False  # no body binds names (sweep items): no step per body
    takes = map(getattr, map(_FN, mediators), itertools.repeat("takes"), itertools.repeat(None))
    if all(map(operator.eq, takes, itertools.repeat(_NOTHING))):
        return False  # no body may take a name (invokes that share none): no step per body
    binders = 0
    for mediator in mediators:
        fn = mediator.fn
        if getattr(fn, "assigns", None) is None:
            continue
        if binders and getattr(fn, "takes", None) != frozenset():
            return True
        binders += 1
    return False


class Sharing:
    """One run's published variables (per invoke, as of its last pause) and who waits for them."""

    __slots__ = ("mediators", "published", "waiters")

    def __init__(self, mediators):
        self.mediators = mediators
        self.published = [{} for _ in mediators]
        self.waiters = []  # (name, mediator): bodies waiting for an earlier invoke's variable

    def publish(self, mediator):
        """`mediator` paused or ended: record the variables it has bound so far."""
        fn = mediator.fn
        assigns = getattr(fn, "assigns", None)
        if not assigns:
            return
        published = self.published[mediator.index]
        if mediator.finished:
            values = fn.out
            for name in assigns:
                if name in values:
                    published[name] = values[name]
            return
        worker = mediator.worker
        values = fn.paused_values(worker.gr_frame) if worker is not None else None
        if values:
            published.update(values)

    def resolve(self, name, reader):
        """What `reader` sees of `name` from earlier invokes: a value, `MISSING` or `WAIT`."""
        for provider in reversed(self.mediators[: reader.index]):
            if name not in (getattr(provider.fn, "assigns", None) or ()):
                continue
            published = self.published[provider.index]
            if name in published:
                return published[name]
            if not provider.finished:
                return WAIT
        return MISSING

    def value(self, interleaver, name, reader, default):
        """Body side: `name` as an earlier invoke bound it, `reader` waiting (the model runs
        on) until that invoke has bound it; `default` when no earlier invoke binds it."""
        while True:
            value = self.resolve(name, reader)
            if value is MISSING:
                return default
            if value is not WAIT:
                return value
            if interleaver.done or reader.worker is not getcurrent():
                return default  # e.g. a backward body inside the invoke: it cannot park here
            self.waiters.append((name, reader))
            reader.event = None
            reader.wait(PARKED)

    # -- the participant protocol (Interleaver.join) --------------------------------------------

    def paused(self, interleaver, mediator):
        self.publish(mediator)

    def ready(self, interleaver):
        """The waiting readers whose name is now bound (or will never be): resumed to look again."""
        if not self.waiters:
            return ()
        ready = [entry for entry in self.waiters if self.resolve(*entry) is not WAIT]
        for entry in ready:
            self.waiters.remove(entry)
        return [(reader, None) for _, reader in ready]

    def finish(self, interleaver):
        """The run is over: a reader still waiting learns its provider never bound the name."""
        waiters, self.waiters = self.waiters, []
        return [(reader, StopSignal() if interleaver.stopped else NameError(
                    f"name {name!r} is not defined: the earlier invoke that assigns it never "
                    f"got there before the run ended"))
                for name, reader in waiters]

    def assigned_earlier(self, name, reader):
        """Does an invoke before `reader` assign `name`?"""
        return any(name in (getattr(m.fn, "assigns", None) or ())
                   for m in self.mediators[: reader.index])
