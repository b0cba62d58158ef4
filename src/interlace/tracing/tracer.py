"""Tracer: a `with` block whose body is captured, skipped, and run through a backend.

    with Tracer() as tracer:      # __enter__: capture (memoised), plan + arm the skip
        h = compute().save()      # never runs inline
    print(h)                      # __exit__: backend(tracer) ran the body, pushed `h` back

A subclass customises the small steps `parse` (find the With node), `build` (the AST to
compile), `compile` (AST -> code) and `execute` (run the code), or passes another `Backend`.
Subclasses that override parse/build/compile get their own capture cache entries.

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

Warm path: on the native path `Tracer.__enter__`/`__exit__` (and `__aenter__`/`__aexit__`)
are C methods (`_cframes.tracer_methods`) that do only mechanism: for a site already captured and planned
they look the Block up in BLOCKS, arm/disarm on skip's stack and call the backend, with no
Python frame of ours. Everything else (a miss, a cached refusal, a pass-only body, a
subclass's `__enter__` calling `super().__enter__()`, any exception, a backend error) goes to
the Python methods below, which are the whole policy and, on the twin, the methods themselves.
"""

from __future__ import annotations

import os
import sys

from .. import _native
from ..errors import InterlaceError
from . import blocks, skip
from .backend import Backend
from .blocks import BLOCKS, Block, _Refusal
from .save import _CURRENT, TraceState
from .save import enter_body as _enter_body
from .save import exit_body as _exit_body

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STEPS = ("parse", "build", "compile")
# ids of Tracer.__enter__ and of every subclass's own __enter__ (kept alive by their classes):
# frames running them are skipped when looking for the user's frame, so that a subclass may
# override __enter__ and call super().__enter__().
_ENTER_CODE_IDS: set = set()


class Tracer:
    """Capture the body of `with Tracer(...):`, skip it, and run it through a backend.

    `args`/`kwargs` are kept for subclasses (e.g. a model's inputs). `backend=None` means the
    default `Backend()`: run the body now against a copy of the caller's locals.
    """

    _capture_key = None  # None: the default steps; a subclass overriding them: the class
    # Per-run state, reset by __exit__ (class-level defaults keep __init__ short):
    block: Block | None = None
    _frame = None  # the caller's frame while the trace runs
    _plan = None  # its skip plan (None for pass-only bodies: they run inline)
    _parent = None  # the enclosing trace's state when nested, read at __enter__
    _state = None  # this trace's TraceState, made when the body first runs

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overrides = any(getattr(cls, name) is not getattr(Tracer, name) for name in _STEPS)
        cls._capture_key = cls if overrides else None
        enter = cls.__dict__.get("__enter__")
        if enter is not None and hasattr(enter, "__code__"):
            _ENTER_CODE_IDS.add(id(enter.__code__))

    def __init__(self, *args, backend=None, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.backend = _DEFAULT_BACKEND if backend is None else backend

    # -- the with protocol (hot path: a warm capture is one dict lookup) --------------------
    # On the native path these two are replaced (below the class) by C methods that do a
    # warm site's lookup, arm, disarm and backend call themselves and call these for the
    # rest; `caller` and `_fired` are how they pass on what they already did.
    def __enter__(self, caller=None):
        frame = _getframe(1) if caller is None else caller
        code = frame.f_code
        if id(code) in _ENTER_CODE_IDS:  # a subclass's __enter__ called super().__enter__()
            while id(code) in _ENTER_CODE_IDS:
                frame = frame.f_back
                code = frame.f_code
        entry = _blocks_get((id(code), frame.f_lasti, self._capture_key))
        if entry is not None and entry[1].__class__ is Block:  # entry[0] is code: ids stay unique
            block = entry[1]
        else:
            try:
                block = blocks.capture(frame, self, self._capture_key)
            except InterlaceError as error:
                __tracebackhide__ = True  # noqa: F841 - pytest/IPython: show the user's line
                raise error.with_traceback(None)  # the capture internals are ours, not the user's
        self.block = block
        self._parent = _current_get()
        if block.passonly:
            self._frame = frame
            return self
        plan = block.skip_plan  # one plan per (code, instruction), like the block itself
        if plan is None or plan.__class__ is _Refusal:
            try:
                plan = _plan(frame, block)
            except InterlaceError as error:
                __tracebackhide__ = True  # noqa: F841
                raise error.with_traceback(None)  # the skip's analysis is ours, not the user's
        self._frame = frame
        self._plan = plan
        skip.arm(frame, plan)
        return self

    def __exit__(self, exc_type, exc, tb, _fired=None):
        plan = self._plan
        try:
            if plan is not None:
                if exc_type is None:
                    if not (skip.disarm(plan) if _fired is None else _fired):
                        raise InterlaceError(
                            f"{self.block.filename}:{self.block.lineno}: internal error: the body of this "
                            f"with block ran inline (the skip did not fire); the backend was not run so "
                            f"that the body does not run twice. Please report this with your Python version."
                        )
                elif not skip.suppresses(plan, exc_type, exc):
                    skip.disarm(plan)
                    return False  # the user's own error (e.g. in the `as` binding): not ours
            elif exc_type is not None:
                return False
            try:
                self.backend(self)
            except BaseException as error:
                # This frame cannot leave the traceback (Python adds the frame that raises);
                # pytest and IPython hide frames that set __tracebackhide__.
                __tracebackhide__ = True  # noqa: F841
                _clean(error, exc)
                raise error  # noqa: B904 - re-raised from the traced body or backend: see the frames below
            return True
        finally:
            self._frame = self._plan = self._state = self._parent = None

    # -- async with: the same work, returned as an awaitable that is already done ---------
    # (the twin's; natively C methods, which add no frame). The coroutine must not suspend
    # between __aenter__ arming the skip and the body start, nor before __aexit__'s result.
    def __aenter__(self):
        return _Ready(self.__enter__())  # __enter__ looks past this frame (_ENTER_CODE_IDS)

    def __aexit__(self, exc_type, exc, tb):
        try:
            return _Ready(self.__exit__(exc_type, exc, tb))
        except BaseException as error:
            __tracebackhide__ = True  # noqa: F841
            _clean(error, None)  # __exit__'s frame goes; this one, which re-raises, stays
            raise error  # noqa: B904

    # -- what backends call ---------------------------------------------------------------
    def trace_state(self) -> TraceState:
        """This trace's save set and depth (nested traces share their outermost's save set)."""
        state = self._state
        if state is None:
            state = self._state = TraceState(self._parent)
        return state

    def run_body(self, namespace=None) -> dict:
        """Run the body against a copy of the caller's locals (or `namespace`); its final locals.

        Sets this trace's save state itself, so it works from any greenlet or thread.
        """
        token = _enter_body(self._state or self.trace_state())  # also mounts `.save()`
        try:
            return self.execute(self.block, namespace)
        finally:
            _exit_body(token)

    def push_result(self, values: dict) -> None:
        """Write the body's results into the caller: all of them when nested, else the saved."""
        names = self.block.assigned_names
        state = self._state or self.trace_state()
        if state.depth:
            out = {name: values[name] for name in names if name in values}
        else:
            saved = state.saved
            out = {name: values[name] for name in names if name in values and id(values[name]) in saved}
        if out and self._frame is not None:
            skip.write_back(self._frame, out)

    # -- steps a subclass may override ----------------------------------------------------
    def capture(self, frame=None) -> Block:
        """The `Block` of the `with` at `frame` (default: this tracer's own, once entered, else
        the caller's); memoised per call site, so capturing again returns the same Block."""
        if frame is None:
            if self.block is not None:
                return self.block
            frame = sys._getframe(1)
        return blocks.capture(frame, self, self._capture_key)

    def parse(self, lines, site):
        """The `ast.With` node at `site` in the source `lines`, or None."""
        return blocks.parse(lines, site)

    def build(self, block, params):
        """The `ast.Module` to compile: a function of `params` (the caller's bound names the body
        mentions) whose body is the block's body, returning its locals."""
        return blocks.build(block, params)

    def compile(self, block, tree):
        """Compile `tree` under the user's filename and the caller's name."""
        return blocks.compile_tree(block, tree)

    def execute(self, block, namespace=None) -> dict:
        """Run the compiled body against a copy of `namespace` (default: the caller's locals)."""
        frame = self._frame
        snapshot = namespace is None
        if snapshot:
            namespace = frame.f_locals  # module: its globals; class: its namespace
        params = tuple([name for name in block.names if name in namespace])
        if frame is not None:
            globals_ = frame.f_globals
            key = (params, id(globals_))
            function = block.callables.get(key)
            if function is None:
                function = block.callables[key] = _make_function(block.function_code(params, self), globals_)
        else:  # a rebuilt (unpickled) tracer: `namespace` is all it has
            function = _make_function(block.function_code(params, self), dict(namespace))
        arguments = [namespace[name] for name in params]
        if snapshot:
            skip.release_locals(frame, namespace)  # the snapshot would keep the caller's locals alive
        result = function(*arguments)
        del result[_LOCALS_PARAM]
        return result

    # -- pickling: no backend, no AST, no per-run state -----------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(backend=None, _frame=None, _plan=None, _state=None, _parent=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.backend is None:
            self.backend = Backend()

    def __repr__(self):
        where = f" at {self.block.filename}:{self.block.lineno}" if self.block is not None else ""
        return f"<{type(self).__name__}{where}>"


_ENTER_CODE_IDS.add(id(Tracer.__enter__.__code__))
_ENTER_CODE_IDS.add(id(Tracer.__aenter__.__code__))


class _Ready:
    """An awaitable that is already done: `await` gives `value` without suspending."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # a generator: the await loop gets StopIteration(value) at its first step


_DEFAULT_BACKEND = Backend()  # stateless: one instance serves every tracer
_getframe = sys._getframe
_blocks_get = BLOCKS.get
_current_get = _CURRENT.get
_make_function = blocks.make_function
_LOCALS_PARAM = blocks.LOCALS_PARAM


def _plan(frame, block):
    """Ask the skip for a plan once per block; its refusal is cached like capture's."""
    plan = block.skip_plan
    if plan is None:
        try:
            plan = block.skip_plan = skip.plan(frame, block)
        except InterlaceError as error:
            block.skip_plan = _Refusal(type(error), str(error))
            raise error.with_traceback(None)
        return plan
    raise plan.error()


def _internal(tb) -> bool:
    filename = tb.tb_frame.f_code.co_filename
    return filename.startswith(_PACKAGE_DIR) or os.path.abspath(filename).startswith(_PACKAGE_DIR)


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


# The warm path in C (the twin returns the Python methods unchanged): the mechanism of a warm
# site (lookup in BLOCKS, arm/disarm on skip's stack, the backend call) without a Python
# frame; the methods above stay the policy for everything else. Every error leaving the C
# methods goes through `_clean` first, so its traceback has no interlace frame.
# (The module keeps the Python methods alive: their code ids are in _ENTER_CODE_IDS.)
_policy_enter, _policy_exit = Tracer.__enter__, Tracer.__exit__  # (benchmarks and tests use them)
_policy_aenter, _policy_aexit = Tracer.__aenter__, Tracer.__aexit__
Tracer.__enter__, Tracer.__exit__, Tracer.__aenter__, Tracer.__aexit__ = _native.frames.tracer_methods(
    Tracer, _policy_enter, _policy_exit, _policy_aenter, _policy_aexit, _clean, BLOCKS, Block,
    skip.SkipPlan, _ENTER_CODE_IDS, skip._local, _CURRENT,
)
