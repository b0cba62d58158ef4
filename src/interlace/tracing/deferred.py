"""DeferredBody: a captured body to run later, anywhere, in its trace's save state.

A backend that does not run the body at once (an interleaving backend runs it in a mediator
while a model runs; an invoke runs it after the enclosing body has collected every invoke; a
sweep runs it once per item, maybe in another process) asks the tracer for one while
`__exit__` runs:

    body = tracer.defer()            # the caller's names the body uses, bound NOW
    values = body.run()              # later, from any greenlet or thread
    body.push(values)                # while __exit__ still runs: results into the caller

What it keeps: the Block, the caller's globals (the module dict), the caller's names the body
mentions bound to the objects they refer to at `defer()` (a loop variable keeps this
iteration's value; a list the caller appends to stays the same list), and the trace's save
state. It keeps no frame: the caller's other locals are not held alive by a body waiting to
run, and `push` writes through the tracer's frame, which exists only while `__exit__` runs.

At module level the caller's variables are the module's globals, and the core's rule for
them holds here too: only the names the body assigns are bound (they start from the global's
value at `defer()`); the names it only reads are global lookups when it runs, as inline (a
function the body defines keeps reading the module's live globals after the block).

`paused_values` and `locals_at` read the frame of the latest `run` (found by its code
object), so they answer for a body that runs once at a time, which is how backends use it.
"""

from __future__ import annotations

import builtins
import copyreg
import types as _types

from .. import _native
from ..errors import InterlaceError
from . import skip
from .block import GENERATOR_PARAMS, LOCALS_PARAM, make_function
from .save import TraceState
from .save import enter_body as _enter_body
from .save import exit_body as _exit_body

_make_function = make_function
_LOCALS_PARAM = LOCALS_PARAM
_bind = _native.frames.bind
_call_bound = _native.frames.call_bound
_pick = _native.frames.pick
_locals = builtins.locals


class DeferredBody(_native.frames.DeferredBase):
    """What running a captured body later needs, and nothing that pins the caller's frame.

    Made by `Tracer.defer()`. Attributes: `tracer`, `block`, `namespace` (the caller's names
    the body uses, as bound at `defer()`), `globals` (the caller's module globals; None for a
    tracer rebuilt from a pickle, whose `namespace` then serves as its globals too), `state`
    (the `TraceState` that `save()` marks into while the body runs).

    The fields and `__init__(tracer, namespace, globals_, state, _params=None)` are
    `frames.DeferredBase`'s (C fields natively, so that `Tracer.defer` makes a body without
    a Python frame); natively `run` is a C method too (`frames.deferred_methods`, installed
    by tracing/tracer.py) that serves a plain `run()` of a warm site and calls the `run`
    below for everything else.
    """

    __slots__ = ()
    _STATE = ("tracer", "block", "namespace", "globals", "state", "_params", "_code", "_entry")

    def __reduce__(self):
        """Copied (and pickled, where its fields pickle) field by field: natively they are C
        fields, which the default protocol would not see."""
        return copyreg.__newobj__, (type(self),), tuple(getattr(self, name) for name in self._STATE)

    def __setstate__(self, state):
        for name, value in zip(self._STATE, state):
            setattr(self, name, value)

    def run(self, namespace=None, globals=None, *, reads_as_globals=False) -> dict:  # noqa: A002 - named as exec() names it
        """Run the body now, in this trace's save state, from any greenlet or thread; its
        final locals.

        `namespace`: the caller's names the body starts from (default: those bound at
        `defer()`); a name the body mentions that is missing from it is unbound in the body,
        as inline. `globals`: the mapping the body's global lookups go to (default: the
        caller's module globals); a mapping of your own may compute names on demand
        (a `dict` subclass with `__missing__`). `reads_as_globals`: names the body only
        reads and that `namespace` lacks are looked up in `globals` (where they may appear
        later) instead of being unbound locals that raise UnboundLocalError.
        """
        block = self.block
        if namespace is None:
            namespace = self.namespace
            params = self._params
        else:
            params = tuple(filter(namespace.__contains__, block.names))
        if globals is None:
            globals_ = self.globals
            if globals_ is None:  # rebuilt from a pickle: the namespace is all there is
                function = _make_function(block.function_code(params, self.tracer, reads_as_globals, self.tracer._frame), dict(namespace))
            else:
                last = block.last_function  # the warm case: the site's previous run's function
                if last is not None and last[1] is globals_ and last[0] == params and not reads_as_globals:
                    function = last[2]
                else:
                    key = (params, id(globals_), True) if reads_as_globals else (params, id(globals_))
                    function = block.callables.get(key)  # (the function keeps globals_, hence its id)
                    if function is None:
                        code = block.function_code(params, self.tracer, reads_as_globals, self.tracer._frame)
                        function = block.callables[key] = _make_function(code, globals_)
                    if not reads_as_globals:
                        block.last_function = (params, globals_, function)
        else:  # a mapping of this run's own: not cached
            function = _make_function(block.function_code(params, self.tracer, reads_as_globals, self.tracer._frame), globals)
        self._code = function.__code__
        self._entry = namespace
        token = _enter_body(self.state)  # also mounts `.save()`
        try:
            result = _call_bound(function, namespace, params)  # function(*(namespace[p] for p in params))
        finally:
            _exit_body(token)
        del result[_LOCALS_PARAM]
        return result

    def generator(self):
        """The body as a generator, for an engine that runs bodies as generators: compiled
        with its reads as yield points (`tracing/generators.py`), started by the first
        `send(None)`; it returns its final locals (pass them through `generator_locals`).
        The caller runs it in this trace's save state (`save.enter_body(body.state)` in
        the context it sends from). Only with the caller's globals (not a pickled tracer)."""
        function, arguments = self.generator_start()
        return function(*arguments)

    def generator_start(self):
        """`(function, arguments)`: `generator()` is `function(*arguments)`. A caller that
        starts the body many times from one namespace (a sweep's items) keeps the pair."""
        block = self.block
        globals_ = self.globals
        namespace = self.namespace
        if globals_ is None:
            raise InterlaceError(f"{block.filename}:{block.lineno}: generator() needs the "
                                 f"caller's globals (a tracer rebuilt from a pickle has none)")
        params = self._params
        if params is None:  # deferred with a namespace of its own: the names it has
            params = tuple(filter(namespace.__contains__, block.names))
        key = ("generator", params, id(globals_))
        function = block.callables.get(key)  # (the function keeps globals_, hence its id)
        if function is None:
            from .generators import DEFAULTS  # (loaded with the capture's parser)

            code = block.generator_code(params, self.tracer, self.tracer._frame)
            function = block.callables[key] = _types.FunctionType(
                code, globals_, code.co_name, (_locals, *DEFAULTS))
        block.last_generator = (params, globals_, function)  # (the compiled `generator`'s)
        self._code = function.__code__
        self._entry = namespace
        return function, tuple(map(namespace.__getitem__, params))

    @staticmethod
    def generator_locals(result: dict) -> dict:
        """The final locals a `generator()` returned, without its hidden parameters."""
        del result[_LOCALS_PARAM]
        for name in GENERATOR_PARAMS:
            del result[name]
        return result

    def results(self, values: dict, state=None) -> dict:
        """What `push` writes of the body's final locals `values`: every name the body
        assigns when the trace is nested in another (the enclosing body goes on with them),
        else only the saved ones. `state`: the save state the body ran in (default: `state`;
        a caller running one body in many states passes the one this run had)."""
        if state is None:
            state = self.state
        return _pick(values, self.block.assigned_names, None if state.depth else state.saved)

    def push(self, values: dict) -> dict:
        """Write `results(values)` into the caller's frame; returns what it wrote.

        The caller's frame is the tracer's while its `__exit__` runs (a backend pushes
        before it returns); after that there is nothing to write into.
        """
        out = self.results(values)
        if out:
            frame = self.tracer._frame
            if frame is None:
                block = self.block
                raise InterlaceError(
                    f"{block.filename}:{block.lineno}: push() after the with block ended: the "
                    f"caller's variables can be written only while the tracer's __exit__ runs. "
                    f"Call push() in the backend, before it returns."
                )
            skip.write_back(frame, out)
        return out

    def locals_at(self, error: BaseException) -> dict:
        """The body's locals where `error` left it (an early-ending signal such as a stop),
        found in the error's traceback; {} when the body's frame is not in it."""
        code = self._code
        block = self.block
        tb = error.__traceback__
        while tb is not None:
            frame_code = tb.tb_frame.f_code
            if frame_code is code or (code is None and frame_code.co_filename == block.filename
                                      and frame_code.co_name == block.co_name):
                values = dict(tb.tb_frame.f_locals)
                values.pop(_LOCALS_PARAM, None)
                for name in GENERATOR_PARAMS:
                    values.pop(name, None)
                return values
            tb = tb.tb_next
        return {}

    def paused_values(self, frame) -> dict | None:
        """For a body paused in a greenlet whose innermost frame is `frame` (`gr_frame`):
        the names the body assigns that it has REBOUND since it started, with their values;
        None when the body's frame is not on that stack (not started, or finished).

        A name that still holds the value the body started with is left out: the body has
        not assigned it yet (a reader waiting for it should go on waiting).
        """
        code = self._code
        if code is None:
            return None
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        if frame is None:
            return None
        values = frame.f_locals
        entry = self._entry
        return {
            name: values[name]
            for name in self.block.assigned_names
            if name in values and (name not in entry or entry[name] is not values[name])
        }

    def __repr__(self):
        block = self.block
        return f"<DeferredBody {block.filename}:{block.lineno} binds {sorted(self.namespace)}>"


def defer(tracer, namespace=None, *, state=None) -> DeferredBody:
    """A handle to run the body later, anywhere: `run()`, `push()`, `locals_at()`,
    `paused_values()` (see `interlace.tracing.deferred`). Call it in the backend, while
    `__exit__` runs: the caller's names the body uses are bound now (a loop variable
    keeps this iteration's value).

    `namespace`: bind these names instead (required on a tracer rebuilt from a pickle,
    which has no caller; it then serves as the globals too). `state`: the `TraceState`
    the body saves into (default: this trace's; a fresh `TraceState(None)` makes a run
    behave as its own top-level trace).

    `Tracer.defer` is a C method natively (`frames.deferred_methods`) that makes a plain
    `defer()` itself and calls this function for everything else; on the twin it is this
    function itself.
    """
    block = tracer.block
    if block is None:
        raise InterlaceError("defer() needs a tracer whose with block was entered: call it from the backend")
    frame = tracer._frame
    if namespace is None:
        if frame is None:
            raise InterlaceError(
                f"{block.filename}:{block.lineno}: defer() without a namespace binds the caller's "
                f"variables, which exist only while the tracer's __exit__ runs (in the backend); "
                f"a tracer rebuilt from a pickle has none: pass `namespace=`."
            )
        # The caller's names the body uses, read in place (the frame mechanism leaves no
        # f_locals snapshot, which would keep the caller's locals alive), in block.names
        # order: so they are the body function's parameters as they are.
        namespace = _bind(frame, block.names)
        params = tuple(namespace)
    else:
        params = None
    globals_ = frame.f_globals if frame is not None else None
    if state is None:
        state = tracer._state
        if state is None:  # `tracer.trace_state()`, inlined (once per trace)
            state = tracer._state = TraceState(tracer._parent)
    return DeferredBody(tracer, namespace, globals_, state, params)
