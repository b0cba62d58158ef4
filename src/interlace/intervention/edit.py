"""Persistent edits: `with model.edit() as edited:` records a body that every later run replays.

The edit block is captured and skipped like a trace's, but nothing runs: its backend records
the body (an `Edit`) on the wrapper. Every later run of that wrapper (a trace, each invoke,
a generation, each sweep item, a direct call `edited(x)`) gets one extra mediator per
recorded edit, added *before* the run's own bodies, so the edits come first in program
order: at a module both wait for, the edit is served first and the trace body sees the
edited value, as if the edit's lines stood at the top of the trace body.

Shapes (nnsight 0.8.1's, chosen by the `as` target the block was written with):

    with model.edit() as edited:                  # the edited copy (model stays clean)
    with model.edit() as (tracer, edited):        # the tracer too, for tracer.iter / all()
    with model.edit(inplace=True) as tracer:      # edits `model` itself
    model.clear_edits()                           # drops every edit of that wrapper

(nnsight 0.8.1 binds a tuple to `as edited`, so `edited.transformer` fails; here a single
name gets the copy.) With several invokes (or sweep items), each runs its own replay of
every edit on its own rows: an edit that indexes the batch (`output[0]`) does for each
input what it does for that input alone.

The names the body uses are bound when the edit is recorded, to the objects they refer to
then (in a function: its locals; at module level, as in nnsight, the globals it names);
other globals stay live lookups. Those bindings are kept by the wrapper, so a reference
from them back to the wrapper would be a cycle that keeps the model alive until the
cyclic collector runs: the wrapper itself (or any wrapper of the same module) and the
edit's own tracer are recorded as markers instead, resolved to the wrapper being run (and
a per-run tracer) at each replay.
"""

from __future__ import annotations

import ast
import functools

from ..errors import InterlaceError
from ..tracing import Backend, Tracer
from ..tracing import blocks as _blocks
from ..tracing.save import TraceState, enter_body, exit_body
from .access import module_of
from .envoy import Envoy
from .iteration import IterMixin


class EditTracer(Tracer):
    """What `model.edit(...)` returns; see the module docstring."""

    def __init__(self, wrapper, inplace=False):
        super().__init__(backend=_RECORD)
        self.inplace = inplace
        self._wrapper = wrapper  # the wrapper the edit goes on; dropped once it is recorded

    def __enter__(self):
        Tracer.__enter__(self)
        wrapper = self._wrapper
        node = self.block.node
        target = node.items[self.block.item_index].optional_vars if node is not None else None
        if isinstance(target, (ast.Tuple, ast.List)):
            return self, wrapper
        return self if self.inplace else wrapper

    @property
    def iter(self):
        raise InterlaceError(_ITER_OUTSIDE.format(what="tracer.iter"))

    def all(self):
        raise InterlaceError(_ITER_OUTSIDE.format(what="tracer.all()"))

    def __getstate__(self):
        state = super().__getstate__()
        state["_wrapper"] = None
        return state


_ITER_OUTSIDE = (
    "{what} of an edit works only inside the `with model.edit() as (tracer, edited):` block's "
    "body, which runs in every later trace of the edited model"
)


class _RecordBackend(Backend):
    """Records the body on the wrapper instead of running it."""

    def __call__(self, tracer):
        wrapper, tracer._wrapper = tracer._wrapper, None
        block = tracer.block
        if block.passonly or wrapper is None:
            return  # nothing to intercept: an edit that does nothing
        body = tracer.defer()
        # a module-level edit binds every global it names (as nnsight does), a function's
        # edit the caller's locals it names; other globals stay live lookups
        names = body.globals if block.kind == "module" else body.namespace
        edit = Edit(tracer, _bind(tracer, wrapper, block, names), body.globals)
        set_edits(wrapper, (*edits_of(wrapper), edit))


_RECORD = _RecordBackend()


class _Marker:
    """Stands for an object that is resolved anew at each replay (see the module docstring)."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<edit marker {self.name}>"

    def __reduce__(self):
        return self.name  # pickles as the module-level singleton


_WRAPPER = _Marker("_WRAPPER")
_TRACER = _Marker("_TRACER")


def _bind(tracer, wrapper, block, names):
    """The caller's names the body mentions, as they are now, with markers for cycles."""
    mentioned = {n.id for stmt in block.statements for n in ast.walk(stmt) if type(n) is ast.Name}
    mentioned -= block.declared_global
    root = module_of(wrapper)
    namespace = {}
    for name in sorted(mentioned):
        if name not in names:
            continue
        value = names[name]
        if value is tracer:
            value = _TRACER
        elif isinstance(value, Envoy) and module_of(value) is root:
            value = _WRAPPER
        namespace[name] = value
    return namespace


class Edit:
    """One recorded edit block: its tracer (the captured body), the caller's names it uses as
    they were when it was recorded, and the globals of the code that recorded it.

    Picklable (for workers in other processes): the globals are cut down to the names the
    body mentions, and the markers pickle as themselves.
    """

    __slots__ = ("tracer", "namespace", "globals")

    def __init__(self, tracer, namespace, globals_):
        self.tracer = tracer
        self.namespace = namespace
        self.globals = globals_

    @property
    def where(self):
        block = self.tracer.block
        return f"{block.filename}:{block.lineno}"

    def __repr__(self):
        return f"<Edit recorded at {self.where}>"

    def body(self, wrapper):
        """The mediator's job for one replay in a run of `wrapper` (an edit's `iter` loop
        just ends with the run: `quiet`, no warning)."""

        def replay():
            namespace = {}
            for name, value in self.namespace.items():
                if value is _WRAPPER:
                    value = wrapper
                elif value is _TRACER:
                    value = EditRun(wrapper)
                namespace[name] = value
            # A save state of its own per replay (whose saves go nowhere: nothing of an edit
            # comes back), and the recorded globals.
            token = enter_body(TraceState(None))  # also mounts `.save()`
            try:
                self._execute(namespace)
            except Exception as error:
                if hasattr(error, "add_note"):
                    error.add_note(
                        f"interlace: raised by the edit recorded at {self.where} "
                        f"(`with model.edit()`), which runs in every trace of the edited model"
                    )
                raise
            finally:
                exit_body(token)

        replay.quiet = True
        return replay

    def _execute(self, namespace):
        """Run the body as a function of the recorded names, under the recorded globals."""
        block = self.tracer.block
        params = tuple(namespace)
        globals_ = self.globals
        key = (params, id(globals_))
        function = block.callables.get(key)  # (the function keeps `globals_`, hence its id)
        if function is None:
            code = block.function_code(params, self.tracer)
            function = block.callables[key] = _blocks.make_function(code, globals_)
        return function(*namespace.values())

    def __getstate__(self):
        block = self.tracer.block
        if block.statements is None:  # already rebuilt from a pickle: its globals are cut down
            names = set(self.globals)
        else:
            names = {n.id for stmt in block.statements for n in ast.walk(stmt)
                     if type(n) is ast.Name}
        # (no __builtins__: a function made on the unpickling side gets that side's own)
        globals_ = {k: v for k, v in self.globals.items() if k in names or k == "__name__"}
        return {"tracer": self.tracer, "namespace": self.namespace, "globals": globals_}

    def __setstate__(self, state):
        for name, value in state.items():
            setattr(self, name, value)


class EditRun(IterMixin):
    """The edit's tracer while its body replays in a run: `tracer.iter[...]` and
    `tracer.all()` of that run (an edit that holds at every generation step loops over
    `tracer.all()`)."""

    __slots__ = ("model",)

    def __init__(self, model):
        self.model = model

    def __repr__(self):
        return "<edit tracer (replaying)>"


def edits_of(wrapper) -> tuple:
    """The edits recorded on `wrapper` (a wrapper's own: copies made from it keep theirs)."""
    return wrapper.__dict__.get("_edits", ())


def replays(wrapper) -> tuple:
    """What `Engine.interleave(edits=...)` takes for a run of `wrapper`: one factory per
    recorded edit, each making a fresh replay body (one per invoke)."""
    edits = wrapper.__dict__.get("_edits")
    if not edits:
        return ()
    return tuple(functools.partial(edit.body, wrapper) for edit in edits)


def set_edits(wrapper, edits):
    """Give `wrapper` these recorded edits (e.g. unpickled in a worker process); returns it."""
    object.__setattr__(wrapper, "_edits", tuple(edits))
    return wrapper


def copy_wrapper(wrapper):
    """A wrapper of the same module sharing the Envoy tree and model state, with its own edits."""
    copy = object.__new__(type(wrapper))
    copy.__dict__.update(wrapper.__dict__)
    return copy
