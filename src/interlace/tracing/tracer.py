"""Tracer: a `with` block whose body is captured, skipped, and run through a backend.

    with Tracer() as tracer:      # __enter__: capture (memoised), plan + arm the skip
        h = compute().save()      # never runs inline
    print(h)                      # __exit__: backend(tracer) ran the body, pushed `h` back

A subclass customises the steps `parse(source, lineno)` (find the With node), `build(node)`
(the body as a module), `compile(module, frame)` (module -> code) and `execute(code)` (run the
body, push the results), or passes another `Backend`. Internally the body becomes a function
of the caller's bound names (`Block.function_code`), made from what `build` returns and
compiled by `compile`, so every route (`execute`, `run_body`, deferred bodies, invokes,
sweeps) runs what the steps made; subclasses that override parse/build/compile get their own
capture cache entries. Overrides of the old shapes (`parse(lines, site)`, `build(block,
params)`, `compile(block, tree)`, `execute(block, namespace)`) work for one more release, with
a DeprecationWarning. A backend runs the body now (`execute`, or `run_body` and `push_result`)
or takes a `DeferredBody` to run later (`defer`). docs/tracer.md is the contract for both.

`async with Tracer():` works like `with` (in a coroutine): `__aenter__`/`__aexit__` do the
same work at once and return an awaitable that is already done, so the coroutine never
suspends between arming the skip and the body start.

Errors: capture refusals (`WithBlockNotFoundError`, `UnsupportedBlockError`) are raised from
`__enter__`; an error raised by the body or the backend is re-raised from `__exit__` with
interlace's own frames removed from its traceback (the user's frames, in any file, stay).
Body exceptions keep their type. On the native path the methods are C functions that clean
every error leaving them and add no frame: the traceback has no interlace frame at all. On
the twin the one Python `__exit__` (or `__aexit__`) frame that re-raises stays (CPython
always records the frame that raises); pytest and IPython hide it (`__tracebackhide__`).

Warm path: the policy (the Python `__enter__` below) captures and plans a site once, then
registers what it decided with the frame mechanism (`frames.register_site`: Block, SkipPlan,
arm arguments, kept on the code object). On the native path `Tracer.__enter__`/`__exit__`
(and `__aenter__`/`__aexit__`) are C methods (`_cframes.tracer_methods`) that serve a
registered site by mechanism alone: set the per-run fields (C fields of `frames.TracerBase`,
read and written by offset, never by attribute name), arm/disarm on C's own per-thread armed
stack and call the backend, with no Python frame of ours. Everything else (a site not yet
registered for this tracer type, a cached refusal, any exception but our skip signal, a
backend error) goes to the Python methods below, which are the whole policy and, on the twin,
the methods themselves (reading the same registered record).
"""

from __future__ import annotations

import os
import sys
import types

from .. import _native
from ..errors import InterlaceError
from . import blocks, skip
from .backend import Backend
from .block import LOCALS_PARAM, Block, make_function
from .blocks import BLOCKS
from .deferred import DeferredBody
from .deferred import defer as _defer
from .save import _CURRENT, TraceState
from .save import enter_body as _enter_body
from .save import exit_body as _exit_body

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Compiled code adds a traceback entry named after its source (the hot path's Tap is called
# inside the model's forward, so a model's own error passes through it).
_NATIVE_SOURCES = ("csrc/_chotpath.pyx", "csrc/_cframes.pyx")
_STEPS = ("parse", "build", "compile")  # the steps that make the Block's code
# step -> (how its old shape's parameters are told apart, the new shape): for one release
_OLD_SHAPES = {
    "parse": (lambda p: p[:2] == ("lines", "site") or p[1:2] == ("site",),
              "parse(self, source: str, lineno: int) -> ast.With | ast.AsyncWith | None"),
    "build": (lambda p: len(p) >= 2 or p[:1] == ("block",),
              "build(self, node) -> ast.Module (whose body is the block's body statements)"),
    "compile": (lambda p: p[:1] == ("block",) or p[1:2] == ("tree",),
                "compile(self, module, frame) -> types.CodeType"),
    "execute": (lambda p: len(p) >= 2 or p[:1] == ("block",),
                "execute(self, code) -> None (runs the body, then push_result)"),
}
_frames = _native.frames
# The fields frames.TracerBase keeps (C fields natively): a class attribute of the same name
# in a subclass would hide the field from Python while C kept using it.
_FIELDS = ("args", "kwargs", "block", "backend", "_frame", "_plan", "_parent", "_state", "_armed")


class Tracer(_frames.TracerBase):
    """Capture the body of `with Tracer(...):`, skip it, and run it through a backend.

    `args`/`kwargs` are kept for subclasses (e.g. a model's inputs). `backend=None` means the
    default `Backend()`: run the body now against a copy of the caller's locals.
    """

    _capture_key = None  # None: the default steps; a subclass overriding them: the class
    _old_steps = frozenset()  # the steps this class overrides with their old shape
    #: Whether an engine may run this tracer's bodies as generators (reads as yield points,
    #: tracing/generators.py). None: only while `build` and `compile` are the defaults; a
    #: subclass that overrides them opts in with True (its statements are then rewritten).
    generator_bodies = None
    _own_execute = False  # overrides `execute` in its new shape (the default backend calls it)
    # Per-run state lives in frames.TracerBase's fields (_FIELDS), None until set: `block`,
    # `backend`, `_frame` (the caller's frame while the trace runs), `_plan` (its SkipPlan; None
    # for pass-only bodies, which run inline), `_parent` (the enclosing trace's state, read at
    # __enter__), `_state` (this trace's TraceState, made when the body first runs), `_armed`
    # (the armed skip between __enter__ and __exit__). __exit__ resets all but `block`/`backend`.

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _check_fields(cls)
        overrides = any(getattr(cls, name) is not getattr(Tracer, name) for name in _STEPS)
        cls._capture_key = cls if overrides else None
        cls._old_steps = _old_steps(cls)
        cls._own_execute = cls.execute is not Tracer.execute and "execute" not in cls._old_steps
        enter = cls.__dict__.get("__enter__")
        if enter is not None and hasattr(enter, "__code__"):
            _frames.look_past(enter.__code__)  # its frame is walked past to find the user's

    # __init__(self, *args, backend=None, **kwargs) is TracerBase's (C on the native path, so
    # that making a tracer runs no Python frame): it keeps `args`/`kwargs` for subclasses and
    # stores the default `Backend()` for backend=None.

    # -- the with protocol: the policy ----------------------------------------------------
    # On the native path these two are replaced (below the class) by C methods that serve a
    # registered site themselves (fields, arm, disarm, backend call) and call these for the
    # rest; `caller` and `_fired` are how they pass on what they already did. On the twin
    # these are the methods, and the registered record is their warm path.
    def __enter__(self, caller=None):
        frame = _user_frame(_getframe(1) if caller is None else caller)  # past subclass __enter__s
        if self._armed is not None:
            raise InterlaceError(
                f"{frame.f_code.co_filename}:{frame.f_lineno}: this tracer is already entered by a "
                f"`with` that has not exited (at {self.block.filename}:{self.block.lineno}); "
                f"use a new tracer for each with block"
            ).with_traceback(None)
        site = _site(frame.f_code, frame.f_lasti, type(self))
        if site is None:
            try:
                site = self._decide(frame)
            except InterlaceError as error:
                __tracebackhide__ = True  # noqa: F841 - pytest/IPython: show the user's line
                raise error.with_traceback(None)  # capture and the skip's analysis are ours
        block, plan, arm_args = site
        self.block = block
        self._parent = _current_get()
        self._frame = frame
        self._plan = plan
        if plan is not None:
            self._armed = _arm(frame, *arm_args)  # last: no Python code of ours runs after it
        return self

    def _decide(self, frame):
        """The policy for a site not yet registered for this tracer type: capture its Block
        (memoised per site in BLOCKS), plan its skip (memoised in skip), and register both
        with the frame mechanism, which serves the site from then on."""
        code = frame.f_code
        key = self._capture_key
        entry = _blocks_get((id(code), frame.f_lasti, key))
        if entry is not None and entry[1].__class__ is Block:  # entry[0] is code: ids stay unique
            block = entry[1]
        else:
            block = blocks.capture(frame, self, key)
        plan = None if block.passonly else skip.plan(frame, block)
        arm_args = None if plan is None else plan.arm_args
        _frames.register_site(code, frame.f_lasti, type(self), block, plan, arm_args)
        return block, plan, arm_args

    def __exit__(self, exc_type, exc, tb, _fired=None):
        plan = self._plan
        armed = self._armed
        try:
            if armed is not None:
                self._armed = None
                _fired = _disarm(armed)  # first: restores any tracer state at once
            if plan is not None:
                if exc_type is None:
                    if not _fired:
                        raise InterlaceError(
                            f"{self.block.filename}:{self.block.lineno}: internal error: the body of this "
                            f"with block ran inline (the skip did not fire); the backend was not run so "
                            f"that the body does not run twice. Please report this with your Python version."
                        )
                elif not skip.suppresses(exc_type):
                    return False  # the user's own error (e.g. in the `as` binding): not ours
            elif exc_type is not None:
                return False
            try:
                self.backend(self)
            except BaseException as error:
                # This frame cannot leave the traceback (Python adds the frame that raises);
                # pytest and IPython hide frames that set __tracebackhide__.
                __tracebackhide__ = True  # noqa: F841 - read from the frame by pytest and IPython
                _clean(error, exc)
                raise error  # noqa: B904 - re-raised from the traced body or backend: see the frames below
            return True
        finally:
            self._frame = self._plan = self._state = self._parent = None

    # -- async with: the same work, returned as an awaitable that is already done ---------
    # (the twin's; natively C methods, which add no frame). The coroutine must not suspend
    # between __aenter__ arming the skip and the body start, nor before __aexit__'s result.
    def __aenter__(self):
        return _Ready(self.__enter__())  # __enter__ looks past this frame (frames.look_past)

    def __aexit__(self, exc_type, exc, tb):
        try:
            return _Ready(self.__exit__(exc_type, exc, tb))
        except BaseException as error:
            __tracebackhide__ = True  # noqa: F841 - read from the frame by pytest and IPython
            _clean(error, None)  # __exit__'s frame goes; this one, which re-raises, stays
            raise error  # noqa: B904 - re-raised as it was, its own context kept

    # -- what backends call ---------------------------------------------------------------
    def trace_state(self) -> TraceState:
        """This trace's save set and depth (nested traces share their outermost's save set)."""
        state = self._state
        if state is None:
            state = self._state = TraceState(self._parent)
        return state

    def run_body(self, namespace=None) -> dict:
        """Run the body against a copy of the caller's locals (or `namespace`); its final locals.

        What runs is `body_code(namespace)`, the code the steps made; nothing is pushed (the
        caller pushes, e.g. after a model ran). Sets this trace's save state itself, so it
        works from any greenlet or thread.
        """
        token = _enter_body(self._state or self.trace_state())  # also mounts `.save()`
        try:
            if "execute" in self._old_steps:  # deprecated: execute(block, namespace) -> values
                return self.execute(self.block, namespace)
            return self._run_code(None, namespace)
        finally:
            _exit_body(token)

    def body_code(self, namespace=None) -> types.CodeType:
        """The body as the steps compiled it: a function of the caller's names the body uses
        that are bound now (or those in `namespace`), plus a last hidden parameter; compiled
        once per set of names. What the default backend hands to `execute`."""
        block = self.block
        frame = self._frame
        names = namespace
        if names is None:
            names = self._caller_names()
        params = tuple(filter(names.__contains__, block.names))
        if namespace is None:
            skip.release_locals(frame, names)  # the snapshot would keep the caller's locals alive
        return block.function_code(params, self, frame=frame)

    # defer(self, namespace=None, *, state=None) -> DeferredBody: see its docstring.
    defer = _defer

    def push_result(self, values: dict) -> None:
        """Write the body's results into the caller: all of them when nested, else the saved."""
        state = self._state or self.trace_state()
        out = _pick(values, self.block.assigned_names, None if state.depth else state.saved)
        if out and self._frame is not None:
            _write_back(self._frame, out)  # skip.write_back's mechanism, called directly

    # -- steps a subclass may override ----------------------------------------------------
    def capture(self, frame=None) -> Block:
        """The `Block` of the `with` at `frame` (default: this tracer's own, once entered, else
        the caller's); memoised per call site, so capturing again returns the same Block."""
        if frame is None:
            if self.block is not None:
                return self.block
            frame = sys._getframe(1)
        return blocks.capture(frame, self, self._capture_key)

    def parse(self, source: str, lineno: int):  # -> ast.With | ast.AsyncWith | None
        """The `with` / `async with` node that starts on line `lineno` of `source` (the file's
        line numbers; a line one of its items starts on also finds it), or None."""
        if type(source) is not str:  # an old-shaped override's super().parse(lines, site)
            return blocks.parse(source, lineno)
        return blocks.parse_source(source, lineno)

    def build(self, node, *_old):  # -> ast.Module
        """The block's body as a module to compile: `node`'s body statements (not the `with`
        line), missing locations filled in. (`build(block, params)`: the old shape.)"""
        if _old:  # an old-shaped override's super().build(block, params)
            return blocks.function_module(node, *_old)
        return blocks.build_module(node)

    def compile(self, module, frame) -> types.CodeType:
        """`module` compiled under `frame`'s filename and future flags, named after `frame`'s
        function, so tracebacks read as if the body ran where it was written. `exec(code,
        globals_dict, locals_dict)` runs it. (`compile(block, tree)`: the old shape.)"""
        if type(module) is Block:  # an old-shaped override's super().compile(block, tree)
            return blocks.compile_tree(module, frame)
        return blocks.compile_module(module, frame)

    def execute(self, code, *_old) -> None:
        """Run the body `code` (`body_code()`) against a copy of the caller's locals, in this
        trace's save state, then write its results back with `push_result`.
        (`execute(block, namespace=None) -> dict`: the old shape.)"""
        if type(code) is Block:  # an old-shaped override's super().execute(block, namespace)
            return self._run_code(None, *_old)
        token = _enter_body(self._state or self.trace_state())  # also mounts `.save()`
        try:
            values = self._run_code(code, None)
        finally:
            _exit_body(token)
        self.push_result(values)

    # -- the steps as the internal routes use them ----------------------------------------
    def _parse_site(self, lines, site):
        """Capture's `parse`: the default finds the node by the site's line and column."""
        parse = type(self).parse
        if parse is _default_parse:
            return blocks.parse(lines, site)
        if "parse" in self._old_steps:
            return self.parse(lines, site)
        return self.parse("".join(lines), blocks.with_line(lines, site.lineno))

    def _parse_source(self, source, lineno):
        """A pickled Block's `parse` of its own source slice."""
        if type(self).parse is _default_parse or "parse" in self._old_steps:
            return blocks.parse_source(source, lineno)
        return self.parse(source, lineno)

    def _built_body(self, node):
        """The statements the body function runs: those of the `build` step's module."""
        if "build" in self._old_steps:  # the old build makes the function module itself
            return list(node.body)
        module = self.build(node)
        if type(module) is not _ast_module():
            raise TypeError(
                f"{type(self).__qualname__}.build returned {type(module).__name__}, not the "
                f"ast.Module whose body is the block's statements (line {node.lineno})"
            )
        return module.body

    def _body_code(self, block, params, reads_as_globals, frame):
        """`Block.function_code`'s miss: the body function of `params` made by the `build`
        step (the old one's, if overridden) and compiled by the `compile` step."""
        from . import syntax  # (loaded by the first capture already)

        if block.statements is None:  # rebuilt after unpickling: parse our own slice again
            syntax.rebuild_statements(block, self)
        if "build" in self._old_steps:
            tree = self.build(block, params)
        else:
            tree = syntax.function_module(block, params)
        if reads_as_globals:
            tree = syntax.globalize_reads(tree, block)
        if "compile" in self._old_steps:
            return self.compile(block, tree)
        code = self.compile(tree, frame if frame is not None else block.stand_in_frame())
        return syntax.function_of(code, block)

    def _generator_code(self, block, params, frame):
        """`Block.generator_code`'s miss: the body function of `_body_code`, with its reads
        made yield points (`tracing/generators.py`), compiled by the `compile` step."""
        from . import generators, syntax  # (loaded by the first capture already)

        if block.statements is None:
            syntax.rebuild_statements(block, self)
        tree, _points = generators.rewrite(syntax.function_module(block, params))
        code = self.compile(tree, frame if frame is not None else block.stand_in_frame())
        return syntax.function_of(code, block)

    def _caller_names(self):
        frame = self._frame
        if frame is None:
            block = self.block
            raise InterlaceError(
                f"{block.filename}:{block.lineno}: this tracer has no caller to run the body "
                f"for (a tracer rebuilt from a pickle, or after its with block ended): pass "
                f"the names the body uses, `run_body(namespace)` or `defer(namespace)`"
            )
        return frame.f_locals  # module: its globals; class: its namespace

    def _run_code(self, code, namespace=None) -> dict:
        """Call the body function `code` (None: `body_code(namespace)`) with its parameters
        bound from `namespace` (default: the caller's locals now); its final locals."""
        block = self.block
        frame = self._frame
        snapshot = namespace is None
        if snapshot:
            namespace = frame.f_locals if frame is not None else self._caller_names()
        if code is None:
            params = tuple(filter(namespace.__contains__, block.names))
        else:
            params = code.co_varnames[: code.co_argcount - 1]  # (the last: LOCALS_PARAM)
        if frame is not None:
            globals_ = frame.f_globals
            key = (params, id(globals_))
            function = block.callables.get(key)
            if function is None or (code is not None and function.__code__ is not code):
                if code is None:
                    code = block.function_code(params, self, frame=frame)
                function = block.callables[key] = _make_function(code, globals_)
        else:  # a rebuilt (unpickled) tracer: `namespace` is all it has
            if code is None:
                code = block.function_code(params, self)
            function = _make_function(code, dict(namespace))
        arguments = list(map(namespace.__getitem__, params))
        if snapshot:
            skip.release_locals(frame, namespace)  # the snapshot would keep the caller's locals alive
        result = function(*arguments)
        del result[_LOCALS_PARAM]
        return result

    # -- pickling: no backend, no AST, no per-run state -----------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()  # (natively TracerBase's fields are not in __dict__)
        state.update(args=self.args, kwargs=self.kwargs, block=self.block, backend=None,
                     _frame=None, _plan=None, _state=None, _parent=None, _armed=None)
        return state

    def __setstate__(self, state):
        for name, value in state.items():
            setattr(self, name, value)  # the per-run fields are TracerBase fields
        if self.backend is None:
            self.backend = Backend()

    def __repr__(self):
        where = f" at {self.block.filename}:{self.block.lineno}" if self.block is not None else ""
        return f"<{type(self).__name__}{where}>"


class _Ready:
    """An awaitable that is already done: `await` gives `value` without suspending."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # a generator: the await loop gets StopIteration(value) at its first step


_default_parse = Tracer.parse
_DEFAULT_BACKEND = Backend()  # stateless: one instance serves every tracer
_getframe = sys._getframe
_blocks_get = BLOCKS.get
_current_get = _CURRENT.get
_site = _frames.site
_user_frame = _frames.user_frame
_arm = _frames.arm
_disarm = _frames.disarm
_write_back = _frames.write_back
_pick = _frames.pick
_make_function = make_function
_LOCALS_PARAM = LOCALS_PARAM


def _ast_module():
    import ast  # (loaded by the first capture already)

    return ast.Module


def _old_steps(cls) -> frozenset:
    """The steps `cls` runs in their old shape (told from the override's parameters); one
    DeprecationWarning, at the class statement, for those `cls` itself defines."""
    old = set()
    for name, (is_old, _) in _OLD_SHAPES.items():
        owner = next(k for k in cls.__mro__ if name in k.__dict__)
        code = getattr(owner.__dict__[name], "__code__", None)
        if owner is not Tracer and code is not None and is_old(code.co_varnames[1 : code.co_argcount]):
            old.add(name)
    mine = [name for name in _OLD_SHAPES if name in old and name in cls.__dict__]
    if mine:
        import warnings

        first = cls.__dict__[mine[0]].__code__
        shapes = "; ".join(_OLD_SHAPES[name][1] for name in mine)
        warnings.warn(
            f"{first.co_filename}:{first.co_firstlineno}: {cls.__qualname__} overrides "
            f"{', '.join(mine)} with the old shape of the Tracer step{'s' if len(mine) > 1 else ''}, "
            f"which works for one more release. Write {shapes} (docs/tracer.md).",
            DeprecationWarning,
            stacklevel=3,  # the class statement (through __init_subclass__)
        )
    return frozenset(old)


def _check_fields(cls) -> None:
    """Refuse a Tracer class that defines a per-run field at class level: the attribute would
    hide the TracerBase field from Python code while the warm path kept using the field."""
    clash = [name for name in _FIELDS if name in cls.__dict__]
    if clash:
        caller = sys._getframe(2)  # the `class` statement (through __init_subclass__)
        raise TypeError(
            f"{caller.f_code.co_filename}:{caller.f_lineno}: {cls.__qualname__} defines "
            f"{', '.join(clash)} at class level, which would hide the tracer's per-run "
            f"field{'s' if len(clash) > 1 else ''} of that name; set "
            f"{'them' if len(clash) > 1 else 'it'} in __init__, or use another name"
        )


def is_interlace_file(filename: str) -> bool:
    """Is `filename` interlace's own code (a module of the package, or a compiled source)?

    The one test of "is this frame ours", for tracebacks and for finding the user's line."""
    if filename.startswith(_PACKAGE_DIR) or filename.endswith(_NATIVE_SOURCES):
        return True
    return not os.path.isabs(filename) and os.path.abspath(filename).startswith(_PACKAGE_DIR)


def user_frame(frame):
    """`frame` or the nearest frame it was called from that is not interlace's (None if none)."""
    while frame is not None and is_interlace_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _internal(tb) -> bool:
    return is_interlace_file(tb.tb_frame.f_code.co_filename)


def _clean(error: BaseException, signal) -> None:
    """Drop interlace's frames from `error`'s traceback and our skip signal from its context."""
    kept = []
    tb = error.__traceback__
    while tb is not None:
        if not _internal(tb):
            kept.append(tb)
        tb = tb.tb_next
    for head, tail in zip(kept, kept[1:]):
        head.tb_next = tail
    if kept:
        kept[-1].tb_next = None
    error.__traceback__ = kept[0] if kept else None
    if signal is not None:  # the twin's skip signal was being handled when the body raised
        seen = set()
        link = error
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            if link.__context__ is signal:
                link.__context__ = signal.__context__
            link = link.__context__


# The warm path in C (the twin returns the Python methods unchanged): the mechanism of a
# registered site (per-run fields, arm/disarm, the backend call) without a Python frame; the
# methods above stay the policy for everything else. Every error leaving the C methods goes
# through `_clean` first, so its traceback has no interlace frame. The policy's own frames
# (the twin's __enter__ called from __aenter__) are walked past like a subclass's __enter__.
_check_fields(Tracer)
_policy_enter, _policy_exit = Tracer.__enter__, Tracer.__exit__  # (benchmarks and tests use them)
_policy_aenter, _policy_aexit = Tracer.__aenter__, Tracer.__aexit__
# The per-trace steps a backend calls, the same way: natively C methods for the warm case
# (`defer()` while __exit__ runs, `push_result`, a plain `run()` of a warm site) that call
# these Python methods for everything else; on the twin these are the methods.
_policy_defer, _policy_push_result, _policy_run = _defer, Tracer.push_result, DeferredBody.run
Tracer.defer, Tracer.push_result, DeferredBody.run = _frames.deferred_methods(
    Tracer, DeferredBody, _policy_defer, _policy_push_result, _policy_run, LOCALS_PARAM,
)
_policy_generator = DeferredBody.generator
DeferredBody.generator = _frames.generator_method(DeferredBody, _policy_generator)
_frames.look_past(_policy_enter.__code__)
_frames.look_past(_policy_aenter.__code__)
Tracer.__enter__, Tracer.__exit__, Tracer.__aenter__, Tracer.__aexit__ = _frames.tracer_methods(
    Tracer, _policy_enter, _policy_exit, _policy_aenter, _policy_aexit, _clean, _CURRENT,
    _DEFAULT_BACKEND,
)
