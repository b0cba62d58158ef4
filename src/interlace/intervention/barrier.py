"""`tracer.barrier(n)`: a meeting point for `n` invoke bodies, mid-forward.

    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(clean):
            h = model.transformer.h[0].output[:, -1]
            barrier()
        with tracer.invoke(corrupt):
            barrier()
            model.transformer.h[0].output[:, -1] = h      # invoke 0's activation, same layer

Every body that calls `barrier()` parks there until `n` bodies have arrived; the last to
arrive lets the others go and carries on itself, so everything above a barrier has happened
before anything below it. The waiting bodies go on at the model's place when the last one
arrives (the model keeps running while they wait, so a body that waits at one layer for a
body that arrives at a later layer continues at that later layer). A barrier can be used
again: each round waits for its own `n` arrivals.

interlace's invokes already wait for a variable an earlier invoke assigns, so the pattern
above works without a barrier too; a barrier orders everything else (values passed through
a shared list or dict, side effects, a later invoke handing something to an earlier one).

A barrier that can never fill is an error, never a hang (nnsight reports a miscounted barrier
only when the run ends, if at all): `barrier()` raises at once when `n` is more than the
trace's invokes, a waiting body gets the error as soon as too few bodies are left to fill it,
and at the latest when the run ends. The error is a `BarrierError` (an `InterlaceError` and
a `ValueError`, as nnsight raises) naming where the barrier was made and who arrived.

The bodies waiting at a run's barriers are that run's `Holds`, a participant in its control
flow (`Interleaver.join`): a body let go is resumed when the body that let it go pauses, a
wait that can no longer be filled ends when a body ends, and one left at the run's end gets
its barrier's error.
"""

from __future__ import annotations

import sys

from ..errors import BarrierError  # re-exported: its home is interlace.errors
from .mediator import PARKED, StopSignal


class Barrier:
    """What `tracer.barrier(n)` returns: call it (`barrier()`) from each of `n` invoke bodies."""

    def __init__(self, engine, n, where):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"tracer.barrier(n) takes the number of invokes that meet there (an int), got {n!r}")
        if n < 1:
            raise ValueError(f"tracer.barrier(n) needs n >= 1 (the number of invokes that call it), got {n}")
        self.n = n
        self._engine = engine  # the engine of the traced model
        self._where = where  # "file:line" of `tracer.barrier(n)`
        self._waiting = []  # the bodies that arrived in this round (emptied at release and teardown)
        self._run = None  # the interleaver whose teardown forgets them

    def __repr__(self):
        return f"<tracer.barrier({self.n}) made at {self._where}, {len(self._waiting)} waiting>"

    def __call__(self):
        """Wait here until `n` bodies have called this barrier (the last one does not wait)."""
        interleaver = self._engine.active()
        if interleaver is None or interleaver.current is None:
            raise BarrierError(
                f"barrier() (the barrier made at {self._where}) is called inside the invoke "
                f"bodies that meet there, while their trace runs (`with tracer.invoke(...):` "
                f"blocks of the trace that made it), not in the trace body around them or "
                f"after it"
            )
        mediator = interleaver.mediator("barrier()")
        holds = Holds.of(interleaver)
        if self._run is not interleaver:
            self._waiting = []
            self._run = interleaver
            interleaver.cleanups.append(self._forget)
        total = len(_bodies(interleaver))
        if self.n > total:
            raise BarrierError(
                f"tracer.barrier({self.n}) made at {self._where} waits for {self.n} invokes, but "
                f"this trace runs {total}: it could never fill. Make it with the number of invokes "
                f"that call it (tracer.barrier({total}) if all of them do)"
            )
        if mediator in self._waiting:
            raise BarrierError(
                f"{mediator.label} called barrier() (made at {self._where}) again while "
                f"already waiting at it"
            )
        self._waiting.append(mediator)
        if len(self._waiting) >= self.n:  # the last one: let the others go, carry on
            others, self._waiting = self._waiting[:-1], []
            for other in others:
                holds.release(other)
            return
        error = self.hopeless(interleaver, mediator)
        if error is not None:
            self._waiting.remove(mediator)
            raise error
        holds.hold(mediator, self)

    # -- what the run's Holds asks a barrier ----------------------------------------------------

    def hopeless(self, interleaver, mediator):
        """The error for `mediator` if the bodies still running can no longer fill this round."""
        arrived = self._waiting
        bodies = _bodies(interleaver)
        coming = [m for m in bodies if not m.finished and m not in arrived]
        if len(arrived) + len(coming) >= self.n:
            return None
        ended = [m.label for m in bodies if m.finished and m not in arrived]
        return BarrierError(
            f"tracer.barrier({self.n}) made at {self._where} can never fill: {self._arrivals()} "
            f"called it, and {', '.join(ended) or 'the other invokes'} ended without calling it. "
            f"Make it with the number of invokes that call it"
        )

    def never_filled(self, interleaver, mediator):
        """The error for `mediator` when the run ended with it still waiting here."""
        return BarrierError(
            f"tracer.barrier({self.n}) made at {self._where} never filled: the model run ended "
            f"while {self._arrivals(mediator)} waited at it for {self.n} arrivals. Make it with "
            f"the number of invokes that call it, and check that each calls it as often"
        )

    def drop(self, mediator):
        if mediator in self._waiting:
            self._waiting.remove(mediator)

    def _arrivals(self, extra=None):
        labels = [m.label for m in self._waiting]
        if extra is not None and extra.label not in labels:
            labels.append(extra.label)
        return f"{len(labels)} of {self.n} ({', '.join(labels)})" if labels else "none"

    def _forget(self):
        """Teardown of the run: the bodies are gone, so is this round."""
        self._waiting = []
        self._run = None


class Holds:
    """The bodies waiting at a run's barriers, and those let go: the run's participant
    (`Interleaver.join`), made when a body first waits at a barrier in that run."""

    __slots__ = ("held", "released", "hopeless")

    def __init__(self):
        self.held = {}  # mediator -> the Barrier it waits at, until released
        self.released = []  # held bodies let go: resumed when the body running now pauses
        self.hopeless = []  # (mediator, error): waits that can no longer be filled

    @staticmethod
    def of(interleaver):
        holds = interleaver.extensions.get("barriers")
        if holds is None:
            holds = interleaver.extensions["barriers"] = Holds()
            interleaver.join(holds)
        return holds

    def hold(self, mediator, barrier):
        """Body side: park `mediator` (the model runs on) until another body `release`s it."""
        self.held[mediator] = barrier
        mediator.event = None
        mediator.wait(PARKED)

    def release(self, mediator):
        """Body side: a held body goes on, at the model's current place, as soon as the
        calling body pauses or ends."""
        if self.held.pop(mediator, None) is not None:
            self.released.append(mediator)

    # -- the participant protocol (Interleaver.join) --------------------------------------------

    def paused(self, interleaver, mediator):
        """A body ended: the waits that can no longer be filled end with their error."""
        if not mediator.finished or not self.held:
            return
        ended = [(m, barrier, barrier.hopeless(interleaver, m)) for m, barrier in self.held.items()]
        for waiter, barrier, error in ended:
            if error is not None and self.held.pop(waiter, None) is not None:
                barrier.drop(waiter)
                self.hopeless.append((waiter, error))

    def ready(self, interleaver):
        if not self.released and not self.hopeless:
            return ()
        ready = [(mediator, None) for mediator in self.released] + self.hopeless
        self.released, self.hopeless = [], []
        return ready

    def finish(self, interleaver):
        """The run is over: bodies let go learn it ended; held ones get their barrier's error."""
        ending = [(mediator, None) for mediator in self.released]
        ending += [(mediator, StopSignal() if interleaver.stopped else barrier.never_filled(interleaver, mediator))
                   for mediator, barrier in self.held.items()]
        for mediator, barrier in self.held.items():
            barrier.drop(mediator)
        self.held, self.released, self.hopeless = {}, [], []
        return ending


def _bodies(interleaver):
    """The run's trace/invoke bodies (not the replayed `model.edit()` bodies: they never meet)."""
    return [m for m in interleaver.mediators if not getattr(m.fn, "quiet", False)]


def make_barrier(tracer, n):
    """`tracer.barrier(n)`: remember where it was made (for error messages)."""
    frame = sys._getframe(2)
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    return Barrier(tracer.engine, n, where)
