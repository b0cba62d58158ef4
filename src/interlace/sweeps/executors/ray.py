"""The Ray executor: batches spread over Ray actors, each holding one replica of the model.

`executor="ray"` connects to a running Ray cluster (`ray.init()` finds it from `RAY_ADDRESS`)
or starts a local one, unless the caller already called `ray.init(...)`. One actor per GPU
when the cluster has GPUs, else `workers=` actors (default: one per CPU of the cluster).

What travels, and how often:

- the model, once: a `LanguageModel` loaded from a repo id or folder is rebuilt on each
  worker from its recipe (id, dtype, device map, keywords) while it is as it loaded (same
  fingerprint); any other model, or one changed since, ships its module once through Ray's
  object store. The actors are kept for the next sweep of the same model until it is
  garbage-collected, `release(model)` or Ray shuts down; when what its forward computes has
  changed since the last sweep (`models/fingerprint.py`: training flags, hooks, structure,
  parameters, buffers, attributes), the same actors rebuild their replica from the new one;
- the body, once per worker and sweep: the captured block, the caller's variables it mentions and the
  globals it reads, pickled by value with cloudpickle -- including functions and classes
  defined in the caller's own module (a script's `__main__`, a notebook, a test file), which
  workers could not import. References to the model (the wrapper, any Envoy of its tree, the
  module) are sent as references and resolve to the worker's replica;
- items and their inputs, per batch (a shared `input=` travels with the body, once).

Batching, grouping by batch key and the failure policy are the local executor's
(`runner.py`): each actor runs its batches with the same `Runner`; the driver commits items
in item order, so the results equal the local executor's. An error for item k: the driver
stops handing out batches after k, lets every item before k finish, and raises the error
(its traceback stays on the worker; its notes name the item and the user's line).
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import sys
import weakref

from ...errors import MissingExtraError  # re-exported: its home is interlace.errors
from ...intervention.access import engine_of, module_of
from ...intervention.edit import edits_of
from ...intervention.envoy import child_of
from ...models.fingerprint import fingerprint
from ..runner import WINDOW, Runner, plan_batches

INSTALL = "pip install 'interlace[ray]' (or pip install ray)"


def require():
    try:
        import ray  # noqa: F401 - only whether it imports
    except ImportError:
        raise MissingExtraError(
            f"executor='ray' runs a sweep on Ray, which is not installed here: {INSTALL}; "
            f"or use executor='local'"
        ) from None


# -- what the driver does ---------------------------------------------------------------------


def run(sweep, job):
    with _ByValue(sweep):
        _run(sweep, job)


def _run(sweep, job):
    import ray

    from .local import committer, entries_of, length_of, progress_bar, take

    if not ray.is_initialized():
        ray.init()
    model = sweep.model
    payload = ray.put(_dump_body(sweep, job))
    actors, recipe = _actors(ray, model, sweep.workers)
    try:
        ray.get([a.load.remote(payload, recipe) for a in actors])
    except Exception:  # noqa: BLE001 - a kept actor died (or its cluster went): make new ones
        release(model)
        actors, recipe = _actors(ray, model, sweep.workers)
        ray.get([a.load.remote(payload, recipe) for a in actors])
    total = length_of(sweep.items)
    bar = progress_bar(sweep, total)
    done = committer(sweep, job, bar)
    shared = job.input is not None and not _is_callable_input(job.input)
    entries = entries_of(sweep, job, done)
    try:
        size = sweep.batch_size
        if size is None:
            head, error = take(entries, 64)
            size = ray.get(actors[0].choose.remote(_ship(head, shared), total))
            if total:  # every worker gets a batch
                size = max(1, min(size, -(-total // len(actors))))
            entries = itertools.chain(head, _raise_later(error) if error is not None else entries)
        sweep.chosen_batch_size = size
        _schedule(ray, actors, entries, size, shared, done, sweep)
    except Exception as error:
        if _item_failure(error):
            raise  # every batch has come back: the actors are idle and stay for the next sweep
        release(model)
        raise
    except BaseException:  # Ctrl-C: batches may still run on the actors
        release(model)
        raise
    finally:
        if bar is not None:
            bar.close()
        pool = _POOLS.get(model)
        if pool is not None:
            ray.get([a.unload.remote() for a in pool.actors])


def _item_failure(error):
    from ..body import item_of

    return item_of(error) is not None


# -- the actors: one pool per model, kept for the next sweep; replicas rebuilt when it changed --

_POOLS = weakref.WeakKeyDictionary()  # model wrapper -> _Pool


class _Pool:
    __slots__ = ("actors", "key", "state")

    def __init__(self, actors, key, state):
        self.actors = actors
        self.key = key  # how many actors, where: a different one needs other actors
        self.state = state  # the model's fingerprint when the replicas were made


def _actors(ray, model, workers):
    """The actors holding `model`'s replicas, and the recipe they must rebuild their replica
    from before this sweep (None while the model is as it was shipped).

    Made once; while the same actors fit, a model changed since the last sweep (any change to
    what its forward computes: `fingerprint`) is shipped to them again rather than new actors
    started. The check costs one fingerprint per sweep (about 2 ms for GPT-2 small).
    """
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    count = workers or gpus or max(1, int(resources.get("CPU", 1)))
    on_gpu = gpus > 0
    context = ray.get_runtime_context()  # a new cluster has new node ids (job ids restart)
    key = (count, on_gpu, context.get_node_id(), context.get_job_id())
    state = fingerprint(module_of(model))
    pool = _POOLS.get(model)
    if pool is not None and pool.key == key:
        if pool.state == state:
            return pool.actors, None
        pool.state = state
        return pool.actors, ray.put(_recipe(model, on_gpu))
    release()  # one pool at a time: another model's actors hold the cluster's CPUs/GPUs
    recipe = ray.put(_recipe(model, on_gpu))
    actor = ray.remote(_Worker).options(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)
    actors = [actor.remote(recipe, number) for number in range(count)]
    _POOLS[model] = _Pool(actors, key, state)
    weakref.finalize(model, _kill, actors)
    return actors, None


def release(model=None):
    """Stop the Ray actors kept for `model` (every model's when None); the next sweep makes new ones.

    Actors stay between sweeps of one model (a replica takes long to build, especially on a
    GPU) until a sweep of another model, its garbage collection, or Ray shutting down.
    """
    models = list(_POOLS) if model is None else [model]
    for each in models:
        pool = _POOLS.pop(each, None)
        if pool is not None:
            _kill(pool.actors)


def _kill(actors):
    try:
        import ray

        if ray.is_initialized():
            for actor in actors:
                ray.kill(actor)
    except Exception:  # noqa: BLE001 - the cluster is gone already: nothing to stop
        pass


def _schedule(ray, actors, entries, size, shared, done, sweep):
    """Hand batches to idle actors until every item ran or one failed (then finish before it)."""
    from ..body import item_of
    from .local import take

    idle = list(actors)
    inflight = {}  # object ref -> batch
    queue = []
    pending = {}  # index -> entry, for every entry drawn and not finished
    failure = None  # (index, error) of the earliest failing item so far
    exhausted = False

    def fail(error, fallback):
        nonlocal failure, exhausted, queue
        index = item_of(error)
        index = fallback if index is None else index
        if failure is None or index < failure[0]:
            failure = (index, error)
        exhausted = True
        running = {e.index for batch in inflight.values() for e in batch}
        rest = [e for i, e in sorted(pending.items())
                if i < failure[0] and i not in running and not done.has(i)]
        queue = plan_batches(rest, size)

    while True:
        while idle and (queue or not exhausted):
            if not queue:
                window, error = take(entries, size * WINDOW)
                for entry in window:
                    pending[entry.index] = entry
                queue = plan_batches(window, size)
                if error is not None:
                    fail(error, window[-1].index + 1 if window else 0)
                elif not window:
                    exhausted = True
                continue
            batch = queue.pop(0)
            inflight[idle.pop().run.remote(_ship(batch, shared), size)] = batch
            sweep.chosen_batch_size = size
        if not inflight:
            break
        ready, _ = ray.wait(list(inflight), num_returns=1)
        batch = inflight.pop(ready[0])
        finished, error, worker, worker_size = ray.get(ready[0])
        idle.append(actors[worker])
        size = min(size, worker_size)
        by_index = {entry.index: entry for entry in batch}
        for index, values in finished:
            pending.pop(index, None)
            done(by_index[index], values)
        if error is not None:
            fail(error, batch[0].index)
    if failure is not None:
        raise failure[1]


def _raise_later(error):
    raise error
    yield  # unreachable: makes this a generator


def _is_callable_input(source):
    import torch

    return callable(source) and not isinstance(source, torch.nn.Module)


def _ship(entries, shared):
    """Entries as sent to a worker: a shared input is left out (the worker has it)."""
    from ..runner import Entry

    if not shared:
        return list(entries)
    return [Entry(e.index, e.item, None, e.kwargs, e.key) for e in entries]


# -- what travels -----------------------------------------------------------------------------


def _recipe(model, on_gpu):
    """How a worker rebuilds `model`: (class, args, kwargs, move the module to the GPU)."""
    cls, args, kwargs, loaded = model.wrapper_recipe()
    if loaded:  # rebuilt from its repo id or folder: a device_map places it already
        return cls, args, kwargs, on_gpu and kwargs.get("device_map") is None
    return cls, args, kwargs, on_gpu


class _BodyPickler:
    """cloudpickle, with the model's wrapper, Envoys and modules sent as references."""

    def __init__(self, model):
        from ray import cloudpickle

        self.model = model
        root = module_of(model)
        modules = {id(m): name for name, m in root.named_modules()}

        class Pickler(cloudpickle.CloudPickler):
            def persistent_id(self, obj):
                if obj is model:
                    return ("envoy", "")
                if _is_envoy(obj) and _same_tree(obj, model):
                    return ("envoy", obj.path)
                name = modules.get(id(obj))
                if name is not None and obj is root.get_submodule(name):
                    return ("module", name)
                return None

        self.pickler = Pickler

    def dumps(self, value):
        buffer = io.BytesIO()
        self.pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return buffer.getvalue()


def _is_envoy(obj):
    from ...intervention.envoy import Envoy

    return isinstance(obj, Envoy)


def _same_tree(envoy, model):
    """Is `envoy` a node of `model`'s Envoy tree (one engine per model, shared by its tree)?"""
    return engine_of(envoy) is engine_of(model)


def _dump_body(sweep, job):
    """The body, the caller's variables and globals it reads, and the job's settings."""
    tracer = sweep
    block = tracer.block
    namespace = dict(job.namespace)
    frame_globals = tracer.defer(job.namespace).globals or {}
    params = tuple(name for name in block.names if name in namespace)
    code = block.function_code(params, tracer)
    wanted = set(block.names) | _global_names(code)
    values = {name: namespace[name] for name in wanted if name in namespace}
    for name in wanted:
        if name not in values and name in frame_globals:
            values[name] = frame_globals[name]
    settings = dict(input=job.input, kwargs=job.kwargs, run=getattr(job.run, "inner", job.run),
                    backward=job.backward, generate=job.generate, eos=job.eos, store=job.store)
    edits = edits_of(sweep.model)  # the wrapper's `model.edit()` blocks: workers replay them too
    return _BodyPickler(sweep.model).dumps((tracer, values, settings, _modes(), edits))


def _modes():
    """The caller's torch modes, which the body runs under (on the worker too)."""
    import torch

    autocast = {}
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                autocast[device] = torch.get_autocast_dtype(device)
        except (RuntimeError, TypeError, AttributeError):  # an older torch
            pass
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast


class _Modes:
    def __init__(self, modes):
        self.grad, self.inference, self.autocast = modes

    def __enter__(self):
        import contextlib

        import torch

        self.stack = stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(self.inference))
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device, dtype in self.autocast.items():
            stack.enter_context(torch.autocast(device, dtype=dtype))

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


class _ByValue:
    """`with _ByValue(sweep):` - the caller's own module is pickled by value meanwhile.

    Workers cannot import a script's `__main__`, a notebook or a test file: its functions and
    classes (in the body's variables, in the items, in what bodies save) travel by value.
    """

    def __init__(self, sweep):
        frame_globals = sweep.defer({}).globals or {}  # the caller's module globals
        module = sys.modules.get(frame_globals.get("__name__", ""))
        self.module = module if module is not None and _is_users_module(module) else None

    def __enter__(self):
        if self.module is not None:
            from ray import cloudpickle

            cloudpickle.register_pickle_by_value(self.module)

    def __exit__(self, *exc):
        if self.module is not None:
            from ray import cloudpickle

            try:
                cloudpickle.unregister_pickle_by_value(self.module)
            except ValueError:  # somebody else unregistered it meanwhile
                pass
        return False


def _global_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def _is_users_module(module):
    """A module workers may not be able to import: the caller's script, notebook, test file."""
    name = module.__name__
    if name == "__main__" or name.split(".")[0] in ("interlace", "torch", "transformers", "ray"):
        return False
    filename = getattr(module, "__file__", None) or ""
    return "site-packages" not in filename and "dist-packages" not in filename


# -- what a worker does -----------------------------------------------------------------------


class _Worker:
    """A Ray actor: one model replica, the body once, then batch after batch."""

    save = None  # not the `.save()` interlace mounts on every object: Ray would ship it

    def __init__(self, recipe, number):
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        self._build(recipe)
        self.number = number
        self.job = self.shared = self.modes = None

    def _build(self, recipe):
        import torch

        cls, args, kwargs, to_gpu = recipe
        self.model = None  # an old replica goes first: two may not fit on the GPU
        self.model = model = cls(*args, **kwargs)
        if to_gpu and torch.cuda.is_available():
            module_of(model).to("cuda")

    def load(self, payload, recipe=None):
        """This sweep's body, the caller's variables and settings (once per sweep); first the
        model again from `recipe` when the driver's has changed since the replica was made."""
        from ..runner import Job

        from ...intervention.edit import set_edits

        if recipe is not None:
            self._build(recipe)
        tracer, namespace, settings, modes, edits = _BodyUnpickler(
            io.BytesIO(payload), self.model).load()
        set_edits(self.model, edits)
        tracer.model = self.model
        tracer._run = settings["run"]  # (sweep.cache() reads it: per-step lists when generating)
        self.job = Job(tracer, namespace, **settings)
        self.shared = settings["input"]
        store = settings["store"]  # save_to=: this worker writes shards of its own
        self.sink = None if store is None else store.sink(self.job, f"w{self.number}")
        self.modes = modes

    def unload(self):
        """The sweep is over: drop its body, variables and edits (the replica stays)."""
        from ...intervention.edit import set_edits

        self.job = self.shared = self.modes = self.sink = None
        set_edits(self.model, ())

    def _entries(self, entries):
        from ..inputs import split

        for entry in entries:
            if entry.args is None:
                entry.args = split(self.shared, {})[0]  # (its keywords came with the entry)
        return entries

    def choose(self, sample, total):
        from ..runner import choose_batch_size

        return choose_batch_size(self.model, self.job, self._entries(sample), total)

    def run(self, entries, size):
        """Run `entries` as the local executor would: (finished (index, values), error, this
        worker's number, its batch size now)."""
        import torch

        from ..results import to_cpu
        from ..store import Stored

        finished = []
        on_gpu = torch.cuda.is_available()
        sink = self.sink

        class Collect:
            def __call__(self, entry, values):
                if sink is not None:  # written here, with the batch (below); the driver counts
                    sink.add(entry, values)
                    values = Stored(0)
                # a worker's GPU is not the driver's: results travel back on the CPU
                finished.append((entry.index, to_cpu(values) if on_gpu else values))

            def many(self, entries, values):
                for entry, saved in zip(entries, values):
                    self(entry, saved)

            def has(self, index):
                return any(i == index for i, _ in finished)

        runner = Runner(self.model, self.job, size)
        if sink is not None:
            sink.flush_rows = float("inf")
        try:
            with _Modes(self.modes):
                try:
                    runner.run_window(self._entries(entries), Collect())
                finally:
                    if sink is not None and finished:
                        finished[-1] = (finished[-1][0], Stored(sink.flush()))
        except Exception as error:  # sent back: the driver finishes the items before it
            error.__traceback__ = None
            return finished, error, self.number, runner.size
        return finished, None, self.number, runner.size


class _BodyUnpickler(pickle.Unpickler):
    def __init__(self, file, model):
        super().__init__(file)
        self.model = model

    def persistent_load(self, pid):
        kind, path = pid
        if kind == "module":
            return module_of(self.model).get_submodule(path)
        envoy = self.model
        for part in path.split(".")[1:] if path else ():
            envoy = child_of(envoy, part)
        return envoy
