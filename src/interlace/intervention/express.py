"""The express run: the common trace served with no hub, mediator or event until it needs one.

Most traces are one input, one body that runs as a generator (routes.py), a model whose
order of locations is learned, and reads of module outputs in the order the model makes
them. For those, what the general run builds per trace (an interleaver's per-run state, a
hub of counters, a mediator, an event per value, hooks through the event exchange) is most
of a trace's own cost, and it is paid in cache lines the forward then fetches again
(docs/architecture.md, "Where a trace's time goes"). An express run does only this:

- it starts the body's generator (its own `contextvars` context and save state, as a
  generator body always has);
- a read of a module's output whose place in the learned order is still ahead sets a
  plain forward wrapper on that module (and on the modules containing it, so that a
  container's output asked for from inside it is served when its call returns) and yields;
  the wrapper hands the output to the body, which goes on until its next read;
- the root's output (`model.output`) and `tracer.result` are sent when the call returns;
- a write (`x.output = value`) to the value being read replaces it, as in the general run.

Anything else the body or the model does (an input, a read out of order, a module that has
hooks of its own, `tracer.stop()`, `.cache()`, a module called inside the body, a read from
a helper function, any use of the running trace other than these reads) *hands over*: the
general run (an `Interleaver`) is built as it would stand had it run the trace from the
start, and finishes it. The hand-over replays what happened (the root's call and each value
read, counted in the hub in order), takes the body's generator as it is (its context, its
pending read re-asked), and replaces the wrappers; everything the user sees is then the
general run's. So the two routes differ in cost only: `INTERLACE_EXPRESS=0` (read at
import) turns this off for comparison and bisecting.

The hand-over is triggered by `Engine.running` (every use of the running trace but the
reads above goes through it) and by this module's own checks.
"""

from __future__ import annotations

import os
import sys
import weakref


from greenlet import getcurrent

from .._native import hotpath
from ..tracing.block import GENERATOR_PARAMS, LOCALS_PARAM
from . import compiled
from .hooks import GLOBAL_HOOKS, _OWN_HOOKS, _tappable
from .interleaver import _READ, Interleaver, _Abort, _Stop, note_last_write
from .body import BodyJob
from .mediator import (
    DONE,
    ENDED_EARLY,
    FAILED,
    PARKED,
    Cancelled,
    GeneratorMediator,
    GenWorker,
    _exit_body,
    close_generator_body,
)

ENABLED = os.environ.get("INTERLACE_EXPRESS", "") != "0"
"""False when INTERLACE_EXPRESS=0: every trace takes the general run."""

_HANDOVER = object()  # sent into a body waiting in `generator_read`: ask the general run
_NONE = -1  # no key

# Where a run is (`stage`): what has happened, for the hand-over's replay and continuation.
# (`ExpressCore.begin` starts it at BODY_START; `run` sets FORWARD and RETURNED)
_FORWARD, _ROOT_FIRED, _RESULT_FIRED = hotpath.FORWARD, hotpath.ROOT_FIRED, hotpath.RESULT_FIRED


hotpath.configure_express(compiled.force_eager, compiled.restore, compiled.quiet_backends,
                          close_generator_body,
                          (_Abort, _Stop), (LOCALS_PARAM, *GENERATOR_PARAMS))


class Express(hotpath.ExpressCore):
    """One model's express runs (one at a time: the engine's lock), and the hand-over.

    A run drives the body's generator itself (what `GenWorker` and `BodyJob` do for the
    general run: its own context and save state, its final locals into `out`); the
    hand-over gives the general run a `GenWorker` and a `BodyJob` made of the same. The run
    (`run`) and the steps it takes per module (its wrappers, `ahead`, `serve`, `switch`)
    are `hotpath.ExpressCore`'s mechanism; this class decides which modules may have a
    wrapper (`_wrap`) and everything else: the run's uncommon cases and the hand-over.
    """

    # (the run's fields, `engine`, `state`, `body`, `out`, `token`, `dead`, `worker`,
    # `error`, `event`, `last_write`, `cut`, are ExpressCore's)
    __slots__ = ("wrappers", "__weakref__")

    def __init__(self, state):
        super().__init__(GLOBAL_HOOKS, _HANDOVER)
        self.engine = None  # the engine, during a run (kept only then: no cycle through it)
        self.state = state
        self.body = self.out = self.token = None
        self.worker = self.error = None
        self.event = self.last_write = None
        self.wrappers = {}  # module index -> (its wrapper, the class and forward it wraps)

    # -- the run ---------------------------------------------------------------------------

    # `run(engine, body, out, args, kwargs)` is `ExpressCore.run`: the common run, start to
    # end (the body started in its context and save state, the root called, everything the
    # run set taken off, the engine's lock released); what it does not do itself is here.

    def _stopped(self):
        """The forward ended early, from a wrapper: the body failed (its error), or the
        general run, handed over, stopped it (its end)."""
        if self.interleaver is None:
            return self._raise()
        return self.interleaver._end(None)

    def _model_failed(self, error):
        """The model raised `error` after a hand-over (the general run hears of it) or after
        the body wrote a value (the error names that write's line); `run` raises it then."""
        if self.interleaver is not None:
            self.interleaver._model_raised(error)
        else:
            note_last_write(error, self.state, self.last_write)

    def _close_general(self, interleaver):
        """The run's end after a hand-over: the general run takes off what it set."""
        interleaver._teardown()

    def _after_return(self, args, result):
        """The root's call returned `result` while the body still waits (or was handed
        over): serve `model.output` and `tracer.result`, or hand over to serve the rest."""
        interleaver = self.interleaver
        if interleaver is None:
            self.position = sys.maxsize  # every module has run
            if self.want == 1 or self.want == self.result_key:
                return self._returned(result)
            interleaver = self.hand_over()  # waits for what never came: it says so
        return interleaver._end(interleaver._root_returned(args, result))

    def _returned(self, result):
        """The root's call returned `result`: serve `model.output`, then `tracer.result`."""
        self.stage = _ROOT_FIRED
        if self.want == 1:
            result = self.serve(1, result)
            interleaver = self.interleaver
            if interleaver is not None:
                return interleaver._end(None if self.cut else interleaver._hand_result(result))
        self.stage = _RESULT_FIRED
        if self.want == self.result_key:
            result = self.serve(self.result_key, result)
            if self.interleaver is not None:
                return self.interleaver._end(result)
        return result

    def _general_from_start(self, message, args, kwargs):
        """The body asked for the general run while it started: go on as it would."""
        interleaver = self.interleaver
        mediator = interleaver.mediators[0]
        interleaver.current = None
        if message == DONE or message == FAILED:
            mediator.release(interleaver.pool)
        interleaver._started(mediator, message)
        result = None
        if not interleaver.stopped and interleaver.failure is None:
            result = interleaver._forward(self.state.root, args, kwargs, True)
        return interleaver._end(result)

    def _raise(self):
        error, self.error = self.error, None
        try:
            raise error
        finally:
            error = None  # (no cycle through this frame's local)

    # -- the body's side -----------------------------------------------------------------------

    def generator_read(self, key, value=_READ):
        """`Interleaver.generator_read` while this run serves the body: yields `~key` until
        the key's wrapper has served it (`serve` resumes the body with None; the value is
        `self.value`); hands over whatever it does not serve. (A read in the body's own
        frame comes through the compiled `reader` first; this is the twin's, and a write's.)"""
        # (only the body's own frame reads here: not another thread, not another body)
        if self.interleaver is None and sys._getframe(1) is self.gen.gi_frame:
            if key == self.serving:  # the value being read now (or a write to it)
                if value is _READ:
                    return self.value
                return self._written(key, value)
            if self.ahead(key):
                got = yield ~key
                if got is not _HANDOVER:  # served: `self.value` is the value as it is now
                    if value is _READ:
                        return self.value
                    return self._written(key, value)
        interleaver = self.interleaver or self.engine.running  # (hands over, or says why not)
        return (yield from interleaver.generator_read(key, value))

    def _read_over(self, key, value=_READ):
        """The general run's read of `key` (with `value`: its write), for a read or write
        that waited at the hand-over."""
        return self.interleaver.generator_read(key, value)

    def generator_write(self, key, value):
        """`Interleaver.generator_write` while this run serves the body."""
        return self.generator_read(key, value)

    def _written(self, key, value):
        frame = self.gen.gi_frame  # (the write is in the body's own frame, at its line)
        self.last_write = (key, frame.f_code.co_filename, frame.f_lineno)
        self.value = value
        self.replaced = True
        return None

    def _wrap(self, index):
        """Set this run's wrapper on module `index` and on the modules containing it that run
        (not the root, whose call this run makes), and keep the decision as `plans[index]`
        for later runs (`ExpressCore.ahead` repeats only its checks); False, having set none,
        when one may not have it (hooks of its own or global ones, a replaced forward:
        `hooks._tappable`)."""
        self.plans.pop(index, None)
        if any(GLOBAL_HOOKS):
            return False
        state = self.state
        visits = state.visits
        wrapped = self.wrapped
        plan = []
        for i in state.ancestors[index] + (index,):
            if i == 0 or not visits[2 * i + 1]:
                continue  # the root, or a container never called (a ModuleList)
            module = state.modules[i]
            instance = module.__dict__
            cached = self.wrappers.get(i)
            if i in wrapped:  # set already in this run (for another key): checked then
                plan.append((i, module, instance, cached[0], cached[1], cached[2],
                             hotpath.PlanCheck()))
                continue
            # a forward of its own (accelerate's, a user's) or hooks of its own: the general run
            if "forward" in instance or any(map(instance.get, _OWN_HOOKS)):
                return False
            cls = type(module)
            forward = cls.forward
            if cached is None or cached[1] is not cls or cached[2] is not forward:
                if not _tappable(instance, cls):
                    return False
                tap = hotpath.ExpressTap(weakref.ref(self), 2 * i + 1, module.forward)
                cached = self.wrappers[i] = (tap, cls, forward)
            plan.append((i, module, instance, cached[0], cls, forward, hotpath.PlanCheck()))
        plan = self.plans[index] = tuple(plan)
        for i, _, instance, wrapper, _, _, check in plan:
            if i not in wrapped:
                instance["forward"] = wrapper
                wrapped[i] = (instance, wrapper, check)
        return True

    # -- the model's side ----------------------------------------------------------------------

    def _served_over(self, key, value, message):
        """`serve`'s end when the run was handed over while the body ran: the general run's
        event carries the edits, and its policy hears the body's message."""
        interleaver = self.interleaver
        event = self.event
        mediator = interleaver.mediators[0]
        interleaver.current = None
        mediator.event = None
        if message != PARKED:
            if message == DONE:
                mediator.release(interleaver.pool)
            elif key == 1 or key == self.result_key:
                try:
                    interleaver._message(mediator, message, event)
                except (_Abort, _Stop):
                    self.cut = True  # (the general run's `_forward` would return None)
            else:
                interleaver._message(mediator, message, event)  # raises: ends the forward
        return event.value if event.replaced else value

    def _failed(self, key):
        """The body failed while served `key`: after the root's call, its error; inside the
        forward, `_Abort` ends it (`run` raises the error then)."""
        if key == 1 or key == self.result_key:
            self._raise()
        raise _Abort()

    def _ended(self, values, error):
        """The body returned `values` or raised `error`: its outcome, as the general run's
        `GenWorker.switch` and `GeneratorMediator.raised` map it. (The compiled run takes
        the common end itself: returned, not handed over.)"""
        worker = self.worker
        if worker is not None:  # handed over: the general run's mediator hears of it
            worker.end()  # (as `GenWorker.switch` ends it)
            return worker.returned(values) if error is None else worker.failed(error)
        self.dead = True
        self.context.run(_exit_body, self.token)
        try:
            if error is None:
                self.out.update(self.body.generator_locals(values))
                return DONE
            if isinstance(error, Cancelled):
                return DONE
            if isinstance(error, ENDED_EARLY):
                self.out.update(self.body.locals_at(error))
                return DONE
            self.error = error
            return FAILED
        finally:
            error = None  # (no cycle through this frame's local)

    # -- the hand-over -----------------------------------------------------------------------

    def hand_over(self):
        """Build the general run as it would stand had it run this trace from the start, give
        it the body, and return it (the engine's running trace from now on). Only from the
        thread running the trace (`Engine.running` sees to it)."""
        engine = self.engine
        state = self.state
        try:
            interleaver = engine.idle.pop()
        except IndexError:
            interleaver = Interleaver(state)
        interleaver.reset(False)
        mediator = GeneratorMediator(BodyJob(self.body, self.out), 0, None, "trace body")
        interleaver.mediators.append(mediator)
        interleaver._setup(True)
        hub = interleaver.hub
        stage = self.stage
        if stage >= _FORWARD:
            hub.fire(0)  # the root's call began (no body asked for its input)
        for key in self.served:
            hub.observe(key)
            hub.fire(key)
        if stage >= _ROOT_FIRED:
            hub.fire(1)
        if stage >= _RESULT_FIRED:
            hub.position = len(state.order)
            hub.fire(self.result_key)
        self.unwrap()
        interleaver.last_write = self.last_write
        self.interleaver = interleaver
        self.want = _NONE
        engine.express = None
        engine.general_run = interleaver
        if self.dead:
            mediator.finished = True
            return interleaver
        worker = self.worker = GenWorker.__new__(GenWorker)  # the body as the general run's
        worker.gen, worker.context, worker.token = self.gen, self.context, self.token
        worker.mediator, worker.home, worker.dead = mediator, getcurrent(), False
        mediator.worker = worker
        mediator.body_grad = self.body_grad
        if self.gen.gi_running:  # asked from the body: it goes on as the general run's
            interleaver.current = mediator
            if self.serving != _NONE:
                event = self.event = hotpath.Event(self.serving, 0, self.value)
                event.replaced = self.replaced
                mediator.event = event
            return interleaver
        # The body waits in `generator_read` for a value this run would have served: ask
        # the general run instead (only the request runs: the body's own code does not).
        interleaver._resume(mediator, None, _HANDOVER)
        return interleaver
