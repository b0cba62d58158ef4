# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled hot path of the interleaving engine; twin: src/interlace/_pyhotpath.py.

Mechanism only: occurrence counters, the position in a model's learned order, the table of
parked requests, and a mediator's iteration pointer. Every decision is made in Python
(interlace/intervention/interleaver.py). Keep this file and the twin equivalent: the suite
runs on both (INTERLACE_NO_EXTENSIONS=1 selects the twin).

Ownership: everything here is Cython-managed Python objects. Arguments are borrowed; every
method returns a new reference (an int, a list, or None); containers stored in a Hub own
strong references to their items (parked waiters are kept alive until `take`/`drain`).
"""

RELAXED = -1


cdef class Hub:
    """Occurrence counters, the position in the learned order, and the parked requests."""

    cdef public list counts
    cdef public list exact
    cdef public dict parked
    cdef public Py_ssize_t nparked
    cdef public Py_ssize_t calls
    cdef public Py_ssize_t position
    cdef public Py_ssize_t root
    cdef public object visits      # tuple[int] or None
    cdef public object positions   # tuple[tuple[int]] or None
    cdef public object record      # list or None

    def __init__(self, Py_ssize_t nkeys, Py_ssize_t root, visits, positions, learning):
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

    cpdef Py_ssize_t fire(self, Py_ssize_t key):
        """A hooked location happened: count it and move the position. Returns its occurrence."""
        cdef Py_ssize_t occ = self.counts[key]
        cdef Py_ssize_t v, j
        self.counts[key] = occ + 1
        if key == self.root:
            self.calls += 1
        if self.record is not None:
            self.record.append(key)
        if self.visits is not None:
            v = (<tuple>self.visits)[key]
            if v:
                j = occ - (self.calls - 1) * v
                if 0 <= j < v:
                    self.position = (<tuple>(<tuple>self.positions)[key])[j]
        return occ

    cpdef Py_ssize_t so_far(self, Py_ssize_t key):
        """How many times `key` has happened so far in this trace (observed or derived)."""
        cdef Py_ssize_t v, n, p
        if self.exact[key]:
            return self.counts[key]
        if self.visits is None or self.calls == 0:
            return 0
        v = (<tuple>self.visits)[key]
        n = (self.calls - 1) * v
        for p in (<tuple>self.positions)[key]:
            if p <= self.position:
                n += 1
        return n

    cpdef observe(self, Py_ssize_t key):
        """`key` is hooked from now on: its counter continues from the derived count."""
        if not self.exact[key]:
            self.counts[key] = self.so_far(key)
            self.exact[key] = True

    cpdef park(self, Py_ssize_t key, Py_ssize_t occ, waiter):
        """Wait for occurrence `occ` of `key`; waiters of one event are served in park order."""
        cdef dict by_occ = self.parked.get(key)
        cdef list waiters
        if by_occ is None:
            by_occ = {}
            self.parked[key] = by_occ
        waiters = by_occ.get(occ)
        if waiters is None:
            by_occ[occ] = [waiter]
        else:
            waiters.append(waiter)
        self.nparked += 1

    cpdef take(self, Py_ssize_t key, Py_ssize_t occ):
        """The waiters of (key, occ), removed from the table; None when nobody waits (fast)."""
        cdef dict by_occ
        cdef list waiters
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

    cpdef list drain(self):
        """Every parked (key, occ, waiter), removed from the table (the run has ended)."""
        cdef list out = []
        for key, by_occ in self.parked.items():
            for occ, waiters in by_occ.items():
                for waiter in waiters:
                    out.append((key, occ, waiter))
        self.parked = {}
        self.nparked = 0
        return out


cdef class Pointer:
    """A mediator's iteration pointer: which occurrence its next request binds to.

    `iteration` >= 0 binds every request to that occurrence (the default is 0: one forward
    pass); `RELAXED` binds each request to the next occurrence of its location not yet
    passed. `pin(n)` makes only the next request bind to `n`, after which the pointer is
    relaxed. `depth` counts enclosing `tracer.iter` loops. `save()`/`restore()` let loops nest.
    """

    cdef public Py_ssize_t iteration
    cdef public Py_ssize_t pinned
    cdef public Py_ssize_t depth

    def __init__(self):
        self.iteration = 0
        self.pinned = RELAXED
        self.depth = 0

    cpdef Py_ssize_t bind(self, Py_ssize_t upcoming):
        """The occurrence a request binds to; `upcoming` is the next one not yet passed."""
        cdef Py_ssize_t occ = self.pinned
        if occ >= 0:
            self.pinned = RELAXED
            self.iteration = RELAXED
            return occ
        occ = self.iteration
        if occ >= 0:
            return occ
        return upcoming

    cpdef pin(self, Py_ssize_t n):
        if n < 0:
            raise ValueError(f"iteration must be >= 0, got {n}")
        self.pinned = n

    cpdef tuple save(self):
        return (self.iteration, self.pinned, self.depth)

    cpdef restore(self, tuple state):
        self.iteration, self.pinned, self.depth = state
