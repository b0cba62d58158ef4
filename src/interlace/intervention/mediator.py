"""A mediator: one trace body (or one invoke's body) running beside the model on its own stack,
or, where the site's route says so (routes.py), as a generator on the model's stack.

The body runs in a greenlet until it needs a value, then parks and hands control back to the
model; a hook hands the value over when the module runs. Greenlets are *reused* across traces
(a small per-thread pool): a fresh greenlet costs an mmap/munmap pair per trace (we measured
a reused greenlet at 1.01-1.02x the plain-hook floor, a fresh one per trace at 1.07-1.09x,
threads at 1.3-1.5x), a reused one costs two switches.

Torch grad mode is thread state, not greenlet state: every switch swaps it, so the body's
own `torch.no_grad()` never leaks into the forward and the forward's state never into the body.
"""

from __future__ import annotations

import sys
import threading
from functools import partial

import torch
from greenlet import getcurrent, greenlet

from .._native import hotpath
from ..tracing.save import current as _trace_running
from ..tracing.save import enter_body as _enter_body
from ..tracing.save import exit_body as _exit_body
from ..tracing.tracer import is_interlace_file, user_frame

_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled

# Messages a worker sends back to the side that resumed it (the hot path's, which reads them).
PARKED = hotpath.PARKED  # the body waits for a value (it is in the hub's table)
DONE = hotpath.DONE  # the body returned
FAILED = hotpath.FAILED  # the body raised; mediator.error holds the exception
STOPPED = hotpath.STOPPED  # the body called tracer.stop()
UNWIND_STOP = hotpath.UNWIND_STOP  # a worker's first frame ends native unwinds


class Cancelled(BaseException):
    """Thrown into a parked body to unwind it (the trace is being torn down)."""


class StopSignal(BaseException):
    """Raised inside the body by `tracer.stop()` after the model was told to stop."""


class IterationCutShort(BaseException):
    """Thrown into a body whose `tracer.iter` loop asked for a step the run never reached.

    It unwinds the body (code after the loop does not run); the interleaver turns it into
    an `IterationCutShortWarning` and keeps what the body saved.
    """


ENDED_EARLY = (StopSignal, IterationCutShort)
"""Signals that end a body early without being an error: what it saved is kept."""


class _Pool(threading.local):
    def __init__(self):
        self.idle = []


WORKERS = _Pool()  # `WORKERS.idle`: this thread's idle workers
# Idle workers are kept per thread, up to `hotpath.POOL_MAX`: enough for a trace with that
# many invokes to start none (a new greenlet costs a creation and a first switch); an idle
# one holds only its short saved stack, a few kB.


def idle_workers() -> list:
    """This thread's idle workers (a run's exchange releases its ended bodies' workers here)."""
    return WORKERS.idle


def _worker_loop():
    """A greenlet's whole life: run jobs forever, reporting each outcome to its parent.

    It is started with no arguments and receives every job through a switch: greenlet keeps
    the arguments of a greenlet's *first* switch alive for as long as the greenlet lives
    (they are the call of its run function), and a pooled greenlet lives as long as its
    thread. A job passed there would keep its mediator, body, tracer and model alive.
    Between jobs the loop holds nothing but the outcome code - not even itself: a local
    naming the greenlet would be a cycle (greenlet -> its frame -> greenlet) that the
    collector cannot break while the greenlet is suspended, so a worker dropped from a full
    pool (a trace with more invokes than the pool keeps) would never be freed. Without it,
    dropping the last reference kills the worker (greenlet raises GreenletExit in it).
    """
    job = getcurrent().parent.switch()
    while True:
        outcome = job()
        job = None
        job = getcurrent().parent.switch(outcome)


# How far below its creator a new worker's C stack starts, where that is safe (natively, with
# `hotpath.outermost`). A worker is made before the model runs and resumed from hooks deep in
# its forward; greenlet copies the part of the forward's stack that overlaps the worker's to
# the heap and back on every switch pair, unless the worker lies below it. Measured on the
# sweep probe (tiny GPT-2, 3 switch pairs per item): 21k instructions of memcpy per item
# -> 3k, 249k -> 230k per item over the floor, about 4 us per item faster (paired rounds in
# one process). 256 KiB is far deeper than a forward's stack; the thread's stack must hold
# twice that (`call_below` checks); a few more pages of it are touched.
_BELOW = 256 * 1024


def _new_worker():
    """A worker for `Mediator.start` when this thread's pool is empty."""
    # Its first native frame is `hotpath.outermost`'s, which ends every unwind of its C stack
    # (natively, on x86-64 and aarch64 Linux).
    worker = greenlet(hotpath.outermost)
    if UNWIND_STOP:  # runs to its first wait, holding no job
        hotpath.call_below(_BELOW, partial(worker.switch, _worker_loop))
    else:
        worker.switch(_worker_loop)
    # A worker made while another trace body runs (a trace nested in a Tracer's body) starts
    # deeper in the C stack than a later trace would resume it from. When torch raises inside
    # a body, its error (c10::Error) records a native backtrace, and an unwinder that walks on
    # past the worker's first frame reads dead frames of the trace that made it, which
    # crashes the process. Where `hotpath.outermost` ends the walk (UNWIND_STOP) the worker
    # is pooled; elsewhere it does this one job only (see docs/architecture.md, "Where a
    # trace's time goes").
    worker.single_use = not UNWIND_STOP and _trace_running() is not None
    return worker


class Mediator(hotpath.MediatorCore):
    """One body, its iteration pointer, and the event it is being served right now.

    `Mediator(fn, index=0, rows=None, label="trace body")`. Every field (fn, index, rows:
    the slice of the batch this body sees or None, pointer, worker, event, error, finished,
    body_grad: the grad mode the body had when it last paused, label) is
    `hotpath.MediatorCore`'s, as is `start(pool=None)`: run the body on a pooled worker until
    its first request (or its end) and return its message. The policy it calls (a new
    worker, this thread's pool) is given to it below (`hotpath.configure`).
    """

    __slots__ = ()

    # -- model side -------------------------------------------------------------------

    def resume(self, payload=None):
        """Hand `payload` to the parked body and run it until it parks again or ends."""
        return self._enter(payload)

    def _enter(self, payload):
        model_grad = _is_grad_enabled()
        if self.body_grad != model_grad:
            _set_grad_enabled(self.body_grad)
        try:
            message = self.worker.switch(payload)
        finally:
            # Back on the model side: restore its mode whatever the body did.
            if _is_grad_enabled() != model_grad:
                _set_grad_enabled(model_grad)
        if message == DONE or message == FAILED:
            self._release()
        return message

    def cancel(self):
        """Unwind a parked body (its `finally` blocks run) and return its worker to the pool."""
        if self.worker is None or self.finished:
            return
        try:
            self._enter(Cancelled)
        except BaseException:  # noqa: BLE001 - a broken body must not block teardown
            pass
        if self.worker is not None:  # the body refused to unwind: drop the greenlet
            self.worker = None

    def _release(self):
        self.release(WORKERS.idle)  # (compiled: the exchange does this itself for a body that ends)

    # -- body side ----------------------------------------------------------------------

    def _job(self):
        try:
            self._run_body()
            return DONE
        except Cancelled:
            self.error = None
            return DONE
        except ENDED_EARLY:
            self.error = None
            return DONE
        except BaseException as error:  # noqa: BLE001 - reported to the model side
            self.error = error
            return FAILED

    def _run_body(self):
        self.fn()

    def paused_frame(self):
        """The innermost frame of the user's code where the parked body waits, or None."""
        worker = self.worker
        return None if worker is None else user_frame(worker.gr_frame)

    def wait(self, message=PARKED):
        """Body side: give control back to the model; returns what the model hands over."""
        body_grad = _is_grad_enabled()
        self.body_grad = body_grad
        self.parks += 1
        # Resumed by the model side, which swapped the mode to body_grad already.
        return self.received(self.worker.parent.switch(message))

    def received(self, payload):
        """Body side: what the model side handed over on resuming the body, raised when it
        is a signal or an error (`Exchange.wait_for` calls it for anything but None)."""
        if payload is Cancelled:
            raise Cancelled()
        if isinstance(payload, BaseException):
            try:
                raise payload
            finally:
                # The error's traceback holds this frame: a local naming the error would make
                # a cycle (error -> traceback -> frame -> error) that keeps the body's frames,
                # hence the model, alive after the user drops the error, until gc runs.
                payload = None
        return payload


runs_here = hotpath.runs_here
"""`runs_here(mediator)`: is the calling code `mediator`'s body (its own lines or what they
call)? A greenlet body runs on its worker; a generator body runs while its generator does, on
the greenlet that resumes it (the model's)."""


def runs_within(mediator) -> bool:
    """`runs_here`, or the calling code is on a greenlet started below the body (the body of
    a trace of another model nested in it)."""
    worker = mediator.worker
    if worker is None:
        return False
    if type(worker) is GenWorker:
        if not worker.gen.gi_running:
            return False
        worker = worker.home
    here = getcurrent()
    while here is not None:
        if here is worker:
            return True
        here = here.parent
    return False


# -- generator bodies (intervention/routes.py decides which body runs how) -----------------

class GenWorker(hotpath.GenCore):
    """A generator body's stand-in for a worker greenlet, in `mediator.worker`.

    The exchange resumes any body with `worker.switch(payload)`; here that sends `payload`
    into the body's generator (in the body's own contextvars context, as a greenlet has
    its own) until it yields PARKED (`hotpath.GenCore`, the mechanism). When the body returns
    or raises, its job hears of it (`fn.finish(values)`, `fn.ended_early(signal)`) and
    `switch` returns the outcome, as `Mediator._job` would (DONE, FAILED); the worker is then
    `dead`. `parent` is what a wait that is not a yield would switch to: a `StrayWait`, which
    refuses. Never pooled (`single_use`): a generator runs once.
    """

    __slots__ = ()
    single_use = True

    # `GenWorker(mediator, gen, state)`: GenCore's; its context is a copy of the caller's, with
    # the body's save state `state` entered there (`.save()` saves into it), its `home` the
    # greenlet that runs the model, and resumes the body. It ends the body (`end()`: `dead`, the
    # save state left) before `returned` (GenCore's: the job's `finish(values)`, DONE) or
    # `failed`.

    def failed(self, error):
        """`switch`'s end when the body raised `error`."""
        mediator, self.mediator = self.mediator, None
        try:
            return mediator.raised(error)
        finally:
            error = None  # (no cycle through this frame's local: see `Mediator.received`)

    def close(self):
        """Drop a body that would not end: its generator is closed, its save state left."""
        if not self.dead:
            self.dead = True
            close_generator_body(self.gen, self.context, self.token)
            self.mediator = None

    @property
    def parent(self):
        # (only a running body waits, and it has its mediator)
        return StrayWait(self.mediator.fn.stray_wait)

    @property
    def gr_frame(self):
        """The innermost frame of the user's code in the suspended body (its yield chain)."""
        return yielding_frame(self.gen)


def close_generator_body(gen, context, token):
    """Close a generator body that did not end (its `finally` blocks run in its `context`),
    then leave its save state (`token`): a broken body must not block a teardown."""
    try:
        context.run(gen.close)
    except BaseException:  # noqa: BLE001 - a broken body must not block teardown
        pass
    context.run(_exit_body, token)


def yielding_frame(gen):
    """The innermost frame of user code (not interlace's) in a suspended generator's chain of
    `yield from`s: where the body waits. None when there is none."""
    found = None
    while gen is not None and hasattr(gen, "gi_frame"):
        frame = gen.gi_frame
        if frame is not None and not is_interlace_file(frame.f_code.co_filename):
            found = frame
        gen = gen.gi_yieldfrom
    return found


class StrayWait:
    """A generator body's `worker.parent`: a wait that is not a yield of the body's own
    frame (a function it calls reads, waits at a barrier...) cannot suspend a generator.
    `switch` refuses with an error naming the user's line, and pins the site to greenlets
    (`on_stray(line)`, routes.py), before the wait has any effect."""

    __slots__ = ("on_stray",)

    def __init__(self, on_stray):
        self.on_stray = on_stray

    def switch(self, message=None):
        frame = user_frame(sys._getframe(1))
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "<unknown>"
        raise self.on_stray(where)


class GeneratorMediator(Mediator):
    """A body run as a generator (its reads are yields, tracing/generators.py): started and
    resumed by `GenWorker.switch`, on the model's own stack, with no worker greenlet. Its
    job gives `generator()` (the body's generator, started here), `finish(values)` and
    `ended_early(signal)`."""

    __slots__ = ()

    # `start(pool)`: the job's `generator()` started on a GenWorker made for it (C, no frame)
    start = hotpath.MediatorCore.start_generator_job

    def cancel(self):
        worker = self.worker
        super().cancel()
        if worker is not None and self.worker is None and not worker.dead:
            worker.close()  # it refused to unwind

    def raised(self, error):
        """The body raised `error`: its outcome, as `_job` maps it."""
        try:
            if isinstance(error, Cancelled):
                self.error = None
                return DONE
            if isinstance(error, ENDED_EARLY):
                self.error = None
                self.fn.ended_early(error)
                return DONE
            self.error = self.fn.failed(error)
            return FAILED
        finally:
            error = None  # (no cycle through this frame's local: see `received`)


class AuditMediator(Mediator):
    """A site's first run: the generator body driven on a worker greenlet. Its yields
    park it as a greenlet body parks; a wait that is not one of its yields (a function it
    calls reads) parks the greenlet directly, and is counted (`parks`). When the body ends
    the count is the verdict (`fn.audited(strays)`, routes.py)."""

    __slots__ = ("gen",)

    def _run_body(self):
        self.parks = 0
        fn = self.fn
        gen, state = fn.generator()
        self.gen = gen
        token = _enter_body(state)  # (this greenlet's own context)
        payload = None
        try:
            while True:
                try:
                    message = gen.send(payload)
                except StopIteration as end:
                    fn.finish(end.value)
                    break
                except ENDED_EARLY as signal:
                    fn.ended_early(signal)
                    raise
                except Exception as error:
                    raise fn.failed(error)
                finally:
                    payload = None
                payload = self.wait_yielded(message)
        finally:
            self.gen = gen = None
            _exit_body(token)
        fn.audited(self.parks)

    def wait_yielded(self, message):
        """The body yielded `message` (PARKED; `prepare` noted its grad mode): switch to the
        model side as `wait` does, uncounted; what the model hands over goes into the body."""
        return self.worker.parent.switch(message)

    def paused_frame(self):
        frame = yielding_frame(self.gen)
        return frame if frame is not None else super().paused_frame()


hotpath.configure(getcurrent, _is_grad_enabled, _set_grad_enabled, _new_worker, idle_workers,
                  _enter_body, _exit_body, GenWorker)
