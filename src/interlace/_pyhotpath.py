"""Pure-Python twin of `csrc/_chotpath.pyx`: the per-event bookkeeping of one trace.

Mechanism only (policy lives in `interlace.intervention.interleaver`). Locations are
small integers (`key`), one per (module, "input"/"output") of a model. Keep this file and
the `.pyx` line-for-line equivalent: the test suite runs on both.

Why a learned order: only modules the body asks for are hooked (a hook on every module
costs 6-16% on a small model), so most locations are never observed. The engine learns
the sequence of locations of one root call once per model; with it, the count of any
location so far follows from the position of the last observed one.
"""

RELAXED = -1
"""`Pointer.iteration` value meaning: bind each request to the next occurrence not yet passed."""


class Hub:
    """Occurrence counters, the position in the learned order, and the parked requests."""

    __slots__ = ("counts", "exact", "parked", "nparked", "calls", "position", "root",
                 "visits", "positions", "record")

    def __init__(self, nkeys, root, visits, positions, learning):
        # visits[key]: how often `key` happens per root call (learned), or None when unknown.
        # positions[key]: the indexes of those happenings in the learned order of one call.
        self.counts = [0] * nkeys
        self.exact = [bool(learning)] * nkeys
        self.parked = {}
        self.nparked = 0
        self.calls = 0
        self.position = -1
        self.root = root
        self.visits = visits
        self.positions = positions
        self.record = [] if learning else None

    def fire(self, key):
        """A hooked location happened: count it and move the position. Returns its occurrence."""
        occ = self.counts[key]
        self.counts[key] = occ + 1
        if key == self.root:
            self.calls += 1
        if self.record is not None:
            self.record.append(key)
        if self.visits is not None:
            v = self.visits[key]
            if v:
                j = occ - (self.calls - 1) * v
                if 0 <= j < v:
                    self.position = self.positions[key][j]
        return occ

    def so_far(self, key):
        """How many times `key` has happened so far in this trace (observed or derived)."""
        if self.exact[key]:
            return self.counts[key]
        if self.visits is None or self.calls == 0:
            return 0
        v = self.visits[key]
        n = (self.calls - 1) * v
        for p in self.positions[key]:
            if p <= self.position:
                n += 1
        return n

    def observe(self, key):
        """`key` is hooked from now on: its counter continues from the derived count."""
        if not self.exact[key]:
            self.counts[key] = self.so_far(key)
            self.exact[key] = True

    def park(self, key, occ, waiter):
        """Wait for occurrence `occ` of `key`; waiters of one event are served in park order."""
        by_occ = self.parked.get(key)
        if by_occ is None:
            by_occ = self.parked[key] = {}
        waiters = by_occ.get(occ)
        if waiters is None:
            by_occ[occ] = [waiter]
        else:
            waiters.append(waiter)
        self.nparked += 1

    def take(self, key, occ):
        """The waiters of (key, occ), removed from the table; None when nobody waits (fast)."""
        if not self.nparked:
            return None
        by_occ = self.parked.get(key)
        if by_occ is None:
            return None
        waiters = by_occ.pop(occ, None)
        if waiters is not None:
            self.nparked -= len(waiters)
            if not by_occ:
                del self.parked[key]
        return waiters

    def drain(self):
        """Every parked (key, occ, waiter), removed from the table (the run has ended)."""
        out = []
        for key, by_occ in self.parked.items():
            for occ, waiters in by_occ.items():
                for waiter in waiters:
                    out.append((key, occ, waiter))
        self.parked = {}
        self.nparked = 0
        return out


class Pointer:
    """A mediator's iteration pointer: which occurrence its next request binds to.

    `iteration` >= 0 binds every request to that occurrence (the default is 0: one forward
    pass); `RELAXED` binds each request to the next occurrence of its location not yet
    passed. `pin(n)` makes only the next request bind to `n`, after which the pointer is
    relaxed. `depth` counts enclosing `tracer.iter` loops. `save()`/`restore()` let loops nest.
    """

    __slots__ = ("iteration", "pinned", "depth")

    def __init__(self):
        self.iteration = 0
        self.pinned = RELAXED
        self.depth = 0

    def bind(self, upcoming):
        """The occurrence a request binds to; `upcoming` is the next one not yet passed."""
        occ = self.pinned
        if occ >= 0:
            self.pinned = RELAXED
            self.iteration = RELAXED
            return occ
        occ = self.iteration
        if occ >= 0:
            return occ
        return upcoming

    def pin(self, n):
        if n < 0:
            raise ValueError(f"iteration must be >= 0, got {n}")
        self.pinned = n

    def save(self):
        return (self.iteration, self.pinned, self.depth)

    def restore(self, state):
        self.iteration, self.pinned, self.depth = state
