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
"""

from __future__ import annotations

MISSING = object()  # no earlier invoke binds the name: the caller's value or a global applies
WAIT = object()  # the earlier invoke that binds it is still running and has not bound it yet


def shares(mediators):
    """Do these bodies need sharing: does a body that binds names come after another one,
    and may it take a name from an earlier one?

    A job's `takes` (the names an earlier invoke assigns that this one does not; None when
    unknown) rules sharing out when it is empty for every later body: then no body can see
    another's variables, and publishing them at every pause would be wasted work.
    """
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

    def assigned_earlier(self, name, reader):
        """Does an invoke before `reader` assign `name`?"""
        return any(name in (getattr(m.fn, "assigns", None) or ())
                   for m in self.mediators[: reader.index])
