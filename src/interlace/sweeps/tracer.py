"""`with model.sweep(items, input=...) as sweep:` - one body, run once per item, batched.

The `with` block is captured and skipped like a trace's; its backend hands the body to an
executor (`executors/local.py`, `executors/ray.py`), which groups the items into batches and
runs each batch as one forward pass with one mediator per item (`runner.py`). Inside the body,
`sweep.item` is the item whose body is running, `sweep.output` its part of the model's return
value, `sweep.iter[...]`/`sweep.all()` its generation steps. After the block, every name the
body saved is bound in the caller to a list of its values in item order (`results.py`).

The rule every path is tested against: an item behaves as if it ran alone in its own trace.
"""

from __future__ import annotations

import os

from ..errors import InterlaceError
from ..intervention.cache import make_cache
from ..intervention.access import engine_of
from ..intervention.grads import block_uses_backward
from ..intervention.iteration import IterMixin
from ..intervention.mediator import runs_here
from ..tracing import Backend, Tracer
from ..tracing.generators import Ready
from . import executors
from .body import ItemBody, caller_namespace, own_state, saved_names
from .results import SweepResults
from .runner import Job, check_batch_size, trim_generated

_CPU = "cpu"  # sweep.cache's default device, as tracer.cache's


class SweepTracer(IterMixin, Tracer):
    """What `model.sweep(...)` returns; see the module docstring and docs/sweeps.md."""

    def __init__(self, model, items, input=None, *, batch_size=None, progress=True,
                 executor="local", workers=None, generate=False, save_to=None,
                 overwrite=False, run=None, kwargs=None, eos=()):
        super().__init__(backend=_SWEEP)
        if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
            raise InterlaceError(
                f"model.sweep(items, ...) takes an iterable of items (a list, a range, a "
                f"generator, a dataset), got {type(items).__name__}"
                + ("; to sweep one prompt, pass [prompt]" if isinstance(items, str) else "")
            )
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                    or workers < 1):
            raise InterlaceError(f"workers must be a positive int or None, got {workers!r}")
        self.model = model
        self.items = items
        self.input = input
        self.batch_size = check_batch_size(batch_size)
        self.progress = progress
        self.executor = executors.get(executor)
        self.workers = workers
        self.generate = generate
        if save_to is not None:
            if not isinstance(save_to, (str, os.PathLike)):
                raise InterlaceError(
                    f"save_to= takes a folder path (a str or os.PathLike), got "
                    f"{type(save_to).__name__}"
                )
            from .store import require

            require()  # now, before the body is skipped
        self.save_to = save_to
        self.overwrite = bool(overwrite)
        self.results = SweepResults()
        self.chosen_batch_size = None  # the batch size the sweep ran with (set when it runs)
        self._run = run
        self._kwargs = kwargs or {}
        self._eos = tuple(eos)
        self._job = None
        self._engine = None  # engine_of(model), once `_body` needs it (per item otherwise)

    # -- inside the body ------------------------------------------------------------------

    @property
    def item(self):
        """The item whose body is running."""
        return self._body("sweep.item").item

    @property
    def index(self):
        """The position of the running item in `items` (0, 1, 2, ...)."""
        return self._body("sweep.index").index

    @property
    def output(self):
        """This item's part of the model's return value (waits for the forward to end).

        With `generate=True`: the item's generated ids (prompt then new tokens), as its
        generation alone returns them (no batch padding, no steps after its own end).
        """
        body = self._body("sweep.output")
        interleaver = engine_of(self.model).active()
        mediator = interleaver.mediator("sweep.output")
        return self._trimmed(body, mediator, interleaver.read(interleaver.state.result_key))

    def __interlace_read__(self, name):
        """`sweep.output` in an item body running as a generator: an iterator that yields
        until the run's end (tracing/generators.py)."""
        if name != "output":
            return Ready(getattr(self, name))
        return self._output_read()

    def _output_read(self):
        body = self._body("sweep.output")
        interleaver = engine_of(self.model).active()
        mediator = interleaver.mediator("sweep.output")
        value = yield from interleaver.generator_read(interleaver.state.result_key)
        return self._trimmed(body, mediator, value)

    @staticmethod
    def _trimmed(body, mediator, value):
        job = body.job
        if job.generate and job.run.mask is not None:
            mask = job.run.mask if mediator.rows is None else job.run.mask[mediator.rows]
            value = trim_generated(value, mask, job.eos)
        return value

    @property
    def engine(self):
        """The model's engine (what runs the batches)."""
        return engine_of(self.model)

    def stop(self):
        """End this item's forward pass here, as `tracer.stop()` would in a trace of the item
        alone: its body ends, keeping what it saved so far, and its `sweep.cache()` records
        nothing more. The other items of its batch go on (the last to stop stops the
        forward pass, see `ItemBody.stop`)."""
        body = self._body("sweep.stop()")  # (which looks up `self._engine`)
        body.stop(self._engine.active())

    def cache(self, modules=None, device=_CPU, dtype=None, detach=True, include_output=True,
              include_inputs=False, non_blocking=False):
        """This item's `tracer.cache(...)`: its own rows of every module's output (or of
        `modules=`), as a trace of the item alone records them; saved, so after the block
        the name is a list of caches, one per item. Call it before the body reads anything.
        See docs/cache.md."""
        body = self._body("sweep.cache()")
        interleaver = self.engine.active()
        before = {key: list(fns) for key, fns in interleaver.observers.items()}
        cache = make_cache(self, modules, device, dtype, detach, include_output,
                           include_inputs, non_blocking)
        added = [(key, fn) for key, fns in interleaver.observers.items()
                 for fn in fns if fn not in before.get(key, ())]
        body.observers = (body.observers or []) + added  # what sweep.stop() ends
        return cache

    def barrier(self, n):
        """Not for sweeps: items are independent runs (see the error)."""
        raise InterlaceError(
            "sweep.barrier(): sweep items run independently, as if each had its own trace "
            "(a batch is not fixed: it depends on the batch size, lengths, retries), so they "
            "cannot meet. To make bodies meet, use one trace with invokes: "
            "`with model.trace() as tracer:`, `barrier = tracer.barrier(n)`, one "
            "`with tracer.invoke(x):` per input; to reuse values from other items, run one "
            "sweep first and read its saved lists in a second"
        )

    def invoke(self, *args, **kwargs):
        """Not for sweeps: each item's inputs come from `input=` (see the error)."""
        raise InterlaceError(
            "sweep.invoke(...): a sweep's items are its invokes; give each item's inputs "
            "with model.sweep(items, input=lambda item: ...) (several arguments: "
            "interlace.Inputs(*args, **kwargs))"
        )

    def _body(self, what):
        """The running item's body: read in the sweep body, or in the body of a trace of
        another model nested in it (which runs inside the item's body)."""
        engine = self._engine
        if engine is None:
            engine = self._engine = engine_of(self.model)
        # (`general_run` is `running` when no express run is on: a property call less per item)
        interleaver = engine.general_run if engine.express is None else engine.running
        mediator = None if interleaver is None else interleaver.current
        if mediator is not None and runs_here(mediator):  # the item's own code (the common case)
            fn = mediator.fn
            if type(fn) is ItemBody and fn.job.tracer is self:
                return fn
        else:
            interleaver = engine.active()
            mediator = None if interleaver is None else interleaver.enclosing()
        if mediator is None:
            raise InterlaceError(
                f"{what} is only available inside the body of `with model.sweep(...) as "
                f"sweep:` while it runs (after the block, read sweep.results)"
            )
        fn = mediator.fn
        if not isinstance(fn, ItemBody) or fn.job.tracer is not self:
            raise InterlaceError(
                f"{what} was read in the body of a trace that is not this sweep's; read it "
                f"in the body of the `with model.sweep(...) as sweep:` block (or of a trace of "
                f"another model nested in it)"
            )
        return fn

    def _running_mediator(self, what):
        mediator = super()._running_mediator(what)
        fn = mediator.fn
        if isinstance(fn, ItemBody):  # a generation that ends early reruns alone (runner.py)
            fn.iter_rows = mediator.rows if mediator.rows is not None else slice(None)
        return mediator

    # -- pickling (Ray ships the tracer to its workers; see executors/ray.py) -------------

    def __getstate__(self):
        state = super().__getstate__()
        state.update(model=None, items=None, input=None, executor=None, results=None,
                     _run=None, _job=None, _engine=None, save_to=None)
        return state

    def __repr__(self):
        where = f" at {self.block.filename}:{self.block.lineno}" if self.block is not None else ""
        return f"<SweepTracer{where}>"


class _SweepBackend(Backend):
    def __call__(self, tracer):
        job = Job(
            tracer, caller_namespace(tracer), tracer.input, tracer._kwargs, tracer._run,
            backward=block_uses_backward(tracer.block), generate=tracer.generate,
        )
        job.eos = tracer._eos
        tracer._job = job
        names = saved_names(tracer.block)
        tracer.results.declare(names)  # bound with zero items too
        if tracer.save_to is not None:  # refused here if the folder holds another sweep
            from .store import Store, make_header

            job.store = Store(tracer.save_to, make_header(tracer, job), names, tracer.overwrite)
        with own_state(tracer) as state:
            try:
                tracer.executor.run(tracer, job)
            finally:
                tracer._job = None
                if job.store is not None:  # what finished is on disk, read back from there
                    job.store.flush()
                    tracer.results = job.store.close()
        values = dict(tracer.results)
        saved = state.saved  # nested in a trace: the lists travel on out
        for value in values.values():
            saved[id(value)] = value
        tracer.push_result(values)


_SWEEP = _SweepBackend()
