"""One sweep item's run of the captured body, with its own save state.

A sweep captures its `with` block once and runs the body once per item, possibly many items
in one forward pass. Each run must behave as if it were the only trace: its own `.save()`
set, its own locals (a fresh copy of the caller's variables), and, when it ends, only the
values it saved. Built on the tracer core's deferred-body API (`Tracer.defer`):

- `caller_namespace(tracer)`: the caller's names the body uses, bound once per sweep as the
  block exits; every item starts from that snapshot;
- `ItemBody`: each item runs the sweep's one `tracer.defer(namespace)` (`Job.body`, made by
  the first item) with a save state of its own, `TraceState(None)` (on a Ray worker too,
  where the tracer was rebuilt from a pickle and the namespace carries the globals the body
  reads). Every run starts from the same namespace, so the items of a batch share it.
"""

from __future__ import annotations

import functools
import weakref

from ..intervention import routes
from ..intervention.mediator import ENDED_EARLY, StopSignal
from ..tracing.save import TraceState
from ..tracing.tracer import is_interlace_file


UNDECIDED = object()
"""`Job.route_block` before the first item asks (`Job.route`)."""


class ItemBody:
    """One item: the runner's entry (its position `index`, the `item`, its forward's `args`
    and `kwargs`, its batch `key`; `runner.Entry` is this class) and the mediator's job that
    runs the body for it (for its sweep's `job`, with the job's `route_block`). One object
    per item, made once when the item is drawn, also when its batch runs again (a retry or a
    run alone).

    `saved` is the name -> value mapping of the names the body assigned *and* saved (set when
    the body ends, also when it ends early: a cut-short `iter` loop keeps what it saved;
    `run_batch` takes it). An error the body raises is marked with the item (`item_of`).
    """

    __slots__ = ("index", "item", "args", "kwargs", "key", "job", "saved", "iter_rows",
                 "observers", "state", "route_block")

    def __init__(self, index, item, args, kwargs, key, job=None, route_block=None):
        self.index = index
        self.item = item
        self.args = args
        self.kwargs = kwargs
        self.key = key
        self.job = job
        self.saved = None
        self.iter_rows = None  # its batch rows, once the body used `tracer.iter`/`all()`
        self.observers = None  # [(key, fn)] its `sweep.cache()` recorders, once it made one
        self.state = None  # its save state while it runs as a generator (`generator`)
        # the sweep body's Block when items may run as generators, None on greenlets: the
        # interleaver reads it to choose the item's route (the job's: `Job.entries` or
        # `run_batch` sets it)
        self.route_block = route_block

    def __reduce__(self):  # what travels to a Ray worker: the entry, not its run
        return (ItemBody, (self.index, self.item, self.args, self.kwargs, self.key))

    def stop(self, interleaver):
        """End this item's run here, as `tracer.stop()` ends a trace of it alone: the body
        ends keeping what it saved, and its caches record nothing more; the batch's other
        items go on. The last item of a batch to stop, when nothing else waits on the model
        (no body, no cache), stops the forward pass itself, as a trace alone would."""
        observers = interleaver.observers
        for key, fn in self.observers or ():
            fns = observers.get(key)
            if fns is not None and fn in fns:
                fns.remove(fn)
        self.observers = None
        current = interleaver.current
        # Scanned from the batch's end: items stop in order, so a later item is usually still
        # running and ends the scan at once (from the start, a batch would cost its size
        # squared).
        if not any(observers.values()) and all(
                m.finished for m in reversed(interleaver.mediators) if m is not current):
            interleaver.stop()  # raises StopSignal once the model was told to stop
        raise StopSignal()

    def __call__(self):
        self.saved = self.iter_rows = self.observers = None  # this run's, not an earlier one's
        job = self.job
        body = job.body or job.deferred()
        # `run` enters the state it finds; `results` reads it after the other items of the
        # batch have run theirs, so it is set again there. A state is reused once its item
        # has finished (`Job.states`): only its `saved` set is per item, and it is emptied.
        states = job.states
        state = body.state = states.pop() if states else TraceState(None)
        values = None
        try:
            values = body.run()
        except ENDED_EARLY as signal:
            values = body.locals_at(signal)
            raise
        except Exception as error:
            name_item(error, self.index, self.item)
            raise
        finally:
            if values is not None:
                body.state = state
                self.saved = body.results(values)
                state.saved.clear()
                states.append(state)


    # -- the generator route (intervention/routes.py) ----------------------------------------

    def generator(self):
        """`__call__`'s body as a generator (its reads are its yields); `finish`,
        `ended_early` or `failed` follows."""
        self.saved = self.iter_rows = self.observers = None
        job = self.job
        states = job.states
        state = self.state = states.pop() if states else TraceState(None)
        return (job.generator_start or self._generator_start())(), state

    def _generator_start(self):
        # every item starts from the sweep's one namespace: the body's generator function and
        # its arguments, looked up once per sweep (`job.body` was made by `job.route()`)
        function, arguments = self.job.body.generator_start()
        start = self.job.generator_start = functools.partial(function, *arguments)
        return start

    def finish(self, values):
        # (`__call__`'s `finally` does the same inline: a Python call per item less there.)
        # `values` are the generator's final locals: its hidden parameters are among them,
        # but `results` picks only names the body assigns, so they need not be dropped.
        job = self.job
        state = self.state
        self.state = None
        self.saved = job.body.results(values, state)
        state.saved.clear()
        job.states.append(state)

    def ended_early(self, signal):
        self.finish(self.job.body.locals_at(signal))

    def failed(self, error):
        if isinstance(error, Exception):
            name_item(error, self.index, self.item)
        return error

    def audited(self, strays):
        routes.audited(self.job.body.block, strays)

    def stray_wait(self, where):
        return routes.stray(self.job.body.block, where)


def name_item(error, index, item):
    """Add a note naming the item and the user's line that raised (once per error)."""
    if not hasattr(error, "add_note") or getattr(error, "_interlace_sweep_item", None) is not None:
        return
    where = fallback = ""
    tb = error.__traceback__
    while tb is not None:  # the innermost frame of the user's own code (not a library's)
        filename = tb.tb_frame.f_code.co_filename
        if not is_interlace_file(filename):
            line = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
            if "site-packages" in filename or "dist-packages" in filename:
                fallback = line
            else:
                where = line
        tb = tb.tb_next
    where = where or fallback
    text = repr(item)
    if len(text) > 120:
        text = text[:117] + "..."
    error.add_note(f"interlace: raised by sweep item {index} ({text}){where}")
    try:
        error._interlace_sweep_item = index
    except AttributeError:  # an exception type with __slots__: the note is enough
        pass


def item_of(error):
    """The index of the sweep item an error was raised by, or None (the model raised it)."""
    return getattr(error, "_interlace_sweep_item", None)


def caller_namespace(tracer):
    """The caller's names the body uses, as they were when the block was entered (one
    snapshot per sweep; call it in the backend).

    Every item's body gets its own locals built from this snapshot (as a trace's body gets
    a copy of the caller's locals), so one item's assignments never reach another item.
    """
    return tracer.defer().namespace


_SAVED_NAMES = weakref.WeakKeyDictionary()  # Block -> saved_names(block): goes with the Block


def saved_names(block):
    """The names the body saves, as its source shows them, in source order: a name assigned
    a `.save()` / `save(...)` call, or one whose `.save()` the body calls (`x.save()`,
    `interlace.save(x)`). What a sweep binds even when no item saved them (zero items).
    Cached per block: the walk of its syntax tree is about 170 Python calls (tiny GPT-2's
    sweep probe), every sweep again without the cache."""
    names = _SAVED_NAMES.get(block)
    if names is None:
        names = _SAVED_NAMES[block] = _find_saved_names(block)
    return list(names)


def _find_saved_names(block):
    import ast  # (the block's capture parsed its source already)

    found = {}

    def mark(node):
        if isinstance(node, ast.Name) and node.id in block.assigned_names:
            found.setdefault(node.id, (node.lineno, node.col_offset))

    for node in ast.walk(ast.Module(body=list(block.statements or ()), type_ignores=[])):
        if isinstance(node, ast.Call):
            saved = _saved_by(node)
            if saved is not None:
                mark(saved)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name, value in _pairs(target, node.value):
                    if _saved_by(value) is not None:
                        mark(name)
    return sorted(found, key=found.__getitem__)


def _saved_by(node):
    """For a save call (`x.save()`, `save(x)`, `interlace.save(x)`), the node saved; else None."""
    import ast

    if not isinstance(node, ast.Call) or node.keywords:
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "save" and not node.args:
        return func.value
    if (isinstance(func, ast.Name) and func.id == "save"
            or isinstance(func, ast.Attribute) and func.attr == "save") and len(node.args) == 1:
        return node.args[0]
    return None


def _pairs(target, value):
    """(name node, value node) of an assignment, element-wise for `a, b = x, y`."""
    import ast

    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            for t, v in zip(target.elts, value.elts):
                yield from _pairs(t, v)
        return
    while isinstance(value, ast.NamedExpr):  # `a = (b := x.save())`
        value = value.value
    if isinstance(target, ast.Name) and value is not None:
        yield target, value


class own_state:
    """`with own_state(tracer) as state:` - the sweep's own trace state (items save into
    states of their own, so the sweep's is never replaced)."""

    def __init__(self, tracer):
        self.state = tracer.trace_state()

    def __enter__(self):
        return self.state

    def __exit__(self, *exc):
        return False
