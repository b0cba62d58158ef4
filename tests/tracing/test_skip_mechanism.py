"""The skip mechanism itself: plans, refusals, caches, bytecode fix-ups, leaks.

These call `interlace.tracing.skip` directly with a minimal stand-in for the Tracer
(`SkipOnly`), so they pin the contract between skip.py and tracer.py.
"""

import asyncio
import dis
import sys
import types

import pytest

import interlace
from interlace import Tracer, UnsupportedBlockError, save
from interlace._native import frames
from interlace.tracing import sites, skip
from interlace import versions as V


class SkipOnly:
    """Skips its body with skip.plan/arm and writes `values` back, like Tracer does."""

    calls = 0

    def __init__(self, values=None, names=(), same_line=False, first_is_try=False):
        self.values = values or {}
        self.names = frozenset(names) | frozenset(self.values)
        self.same_line = same_line
        self.first_is_try = first_is_try

    def __enter__(self):
        return self._enter(sys._getframe(1))

    def _enter(self, frame):
        block = types.SimpleNamespace(
            filename=frame.f_code.co_filename, lineno=frame.f_lineno,
            first_body_line=frame.f_lineno + 1, same_line=self.same_line,
            first_is_try=self.first_is_try, assigned_names=self.names,
        )
        self.frame = frame
        self.plan = skip.plan(frame, block)
        self.handle = skip.arm(frame, self.plan)
        return self

    def __exit__(self, exc_type, exc, tb):
        fired = skip.disarm(self.handle)
        if exc_type is not None and not skip.suppresses(exc_type):
            return False
        assert fired, "the body ran inline"
        skip.write_back(self.frame, self.values)
        self.frame = None
        return True

    async def __aenter__(self):
        return self._enter(sys._getframe(1))

    async def __aexit__(self, *exc):
        return self.__exit__(*exc)


def test_the_live_path_is_what_interlace_native_says():
    assert frames.COMPILED is interlace.native
    assert skip.frames is frames


def test_plan_is_cached_per_code_object_and_instruction():
    plans = []

    class Recording(SkipOnly):
        def __exit__(self, *exc):
            plans.append(self.plan)
            return super().__exit__(*exc)

    def f():
        with Recording({"h": 1}):
            h = 0
        return h

    def g():
        with Recording({"h": 2}):
            h = 0
        return h

    assert [f(), f(), g()] == [1, 1, 2]
    assert plans[0] is plans[1] and plans[2] is not plans[0]
    assert plans[0].filename == __file__
    assert plans[0].lineno == f.__code__.co_firstlineno + 1


def test_write_back_targets_fast_locals_cells_globals_and_class_bodies():
    def fast():
        with SkipOnly({"a": 1}):
            a = 0
        return a

    def cell():
        with SkipOnly({"c": 2}):
            c = 0
        return (lambda: c)()

    class Body:
        with SkipOnly({"k": 3}):
            k = 0

    assert (fast(), cell(), Body.k) == (1, 2, 3)


def test_write_back_targets_an_argument_that_is_a_cell_and_a_nonlocal():
    def argument(x):
        with SkipOnly({"x": 7}):
            x = 0
        return x, (lambda: x)()

    def outer():
        v = 0

        def inner():
            nonlocal v
            with SkipOnly({"v": 8}):
                v = 1

        inner()
        return v

    assert (argument(1), outer()) == ((7, 7), 8)


def _bound(frame, names):
    """The reference for frames.bind: the names of `names` in `f_locals`, in that order."""
    scope = frame.f_locals
    return {name: scope[name] for name in names if name in scope}


def test_bind_reads_what_f_locals_holds_in_names_order():
    names = ("g", "free", "cell", "arg", "plain", "unbound", "missing")
    g = None  # noqa: F841 - a local here; `g` in `scope` below is not
    free = object()

    def scope(arg):
        plain = [free]
        cell = 3
        got = frames.bind(sys._getframe(), names)
        want = _bound(sys._getframe(), names)
        unbound = (lambda: (arg, cell))()
        return got, want, unbound, plain

    got, want, _, _ = scope("a")
    assert got == want and list(got) == list(want) == ["free", "cell", "arg", "plain"]
    assert got["free"] is free

    class Body:
        k = 1
        got = frames.bind(sys._getframe(), ("j", "k", "free"))

    assert Body.got == {"k": 1}
    module = {"__name__": "m"}
    exec("a = 1\nout = frames.bind(sys._getframe(), ('b', 'a', 'frames'))", {"frames": frames, "sys": sys}, module)
    assert module["out"] == {"a": 1}
    at_module = {"frames": frames, "sys": sys, "a": 2}
    exec("out = frames.bind(sys._getframe(), ('a', 'frames'))", at_module)
    assert at_module["out"] == {"a": 2, "frames": frames}


def test_bind_leaves_no_snapshot_holding_the_callers_locals():
    import gc
    import weakref

    class Big:
        pass

    def scope():
        big = Big()
        ref = weakref.ref(big)
        locals()  # 3.10-3.12: leaves a snapshot on the frame holding `big`
        assert frames.bind(sys._getframe(), ("big",))["big"] is big
        del big
        return ref()

    gc.disable()
    try:
        assert scope() is None
    finally:
        gc.enable()


def test_async_with_site():
    ran = []

    async def f():
        async with SkipOnly({"h": 5}) as t:
            ran.append(t)
            h = 0
        await asyncio.sleep(0)
        return h

    assert asyncio.run(f()) == 5
    assert asyncio.run(f()) == 5
    assert ran == []


@pytest.mark.skipif(interlace.native, reason="the twin's refusals")
def test_twin_refuses_a_body_on_the_with_line_with_a_clear_message():
    def f():
        with Tracer(): h = save(1)  # noqa: E701
        return h

    with pytest.raises(UnsupportedBlockError) as info:
        f()
    message = str(info.value)
    line = f.__code__.co_firstlineno + 1
    assert f"{__file__}:{line}" in message
    assert "does not start on a line of its own" in message
    assert "Build the native extension" in message
    assert "move the body to its own line" in message


@pytest.mark.skipif(interlace.native, reason="the twin's refusals")
def test_twin_refuses_a_try_first_body_with_a_clear_message():
    def f():
        with Tracer():
            try:
                h = save(1)
            finally:
                pass
        return h

    with pytest.raises(UnsupportedBlockError) as info:
        f()
    message = str(info.value)
    assert f"{__file__}:{f.__code__.co_firstlineno + 1}" in message
    assert "first statement is a `try`" in message
    assert "put a statement before the `try`" in message


@pytest.mark.skipif(interlace.native, reason="the twin's refusals")
def test_twin_refusal_is_raised_before_the_body_runs_and_the_next_trace_works():
    ran = []

    def f():
        with Tracer(): ran.append(1)  # noqa: E701

    with pytest.raises(UnsupportedBlockError):
        f()
    assert ran == []
    with pytest.raises(UnsupportedBlockError):
        f()  # the verdict is cached
    assert ran == []


def test_site_analysis_finds_body_start_and_verified_exit():
    def f(T):
        with T() as t:
            h = 1
        return h, t

    code = f.__code__
    enter = next(i for i in dis.get_instructions(code) if i.opname in V.WITH_ENTER_OPS)
    site = sites.analyse(code, enter.offset)
    by_offset = {i.offset: i for i in dis.get_instructions(code)}
    assert site.body_line == code.co_firstlineno + 2
    assert by_offset[site.body_start * 2].opname == "LOAD_CONST"
    assert site.line_start and not site.fused_binding
    exit_instr = by_offset[site.exit_unit * 2]
    assert exit_instr.opname in ("POP_BLOCK", "LOAD_CONST")
    assert site.refusal is None


def test_site_analysis_refuses_a_jump_to_an_inlined_return_exit():
    # the only exit sequence after the body start belongs to `return`: never jump there
    def f(T):
        with T():
            return 1

    code = f.__code__
    enter = next(i for i in dis.get_instructions(code) if i.opname in V.WITH_ENTER_OPS)
    site = sites.analyse(code, enter.offset)
    assert site.exit_unit is None
    assert site.refusal


def test_lookup_error_when_no_with_at_that_instruction():
    def f():
        return 1

    with pytest.raises(LookupError):
        sites.analyse(f.__code__, 0)


@pytest.mark.skipif(not (interlace.native and V.NEEDS_LOAD_CHECKS), reason="3.12+ native fix-up")
def test_unchecked_reads_of_body_bound_names_become_checked():
    def f(T):
        with T():
            h = 1
        return h

    assert [i.opname for i in dis.get_instructions(f) if i.argval == "h"].count("LOAD_FAST") >= 1
    with pytest.raises(UnboundLocalError):
        f(lambda: SkipOnly(names=("h",)))
    adaptive = [i.opname for i in dis.get_instructions(f, adaptive=True) if i.argval == "h"]
    assert "LOAD_FAST" not in adaptive and "LOAD_FAST_CHECK" in adaptive
    assert f(lambda: SkipOnly({"h": 3})) == 3


def test_no_armed_handle_outlives_its_trace():
    def f():
        with SkipOnly({"h": 1}):
            h = 0
        return h

    before = frames.armed_count()
    for _ in range(100):
        f()
    assert frames.armed_count() == before


def test_frames_are_not_kept_alive():
    import gc
    import weakref

    refs = []

    Spy = SkipOnly

    def f():
        probe = type("Probe", (), {})()
        refs.append(weakref.ref(probe))
        with Spy({"h": 1}):
            h = 0
        return h

    f()
    gc.collect()
    assert refs[0]() is None


@pytest.mark.skipif(not (interlace.native and V.PY313_PLUS), reason="3.13 native fix-up")
def test_fused_reads_after_the_block_are_redirected_to_the_checked_copy():
    import contextlib

    plans = []

    class Recording(SkipOnly):
        def __exit__(self, *exc):
            plans.append(self.plan)
            return super().__exit__(*exc)

    def f(T):
        with T():
            a = 1
            b = 2
        return a + b

    assert "LOAD_FAST_LOAD_FAST" in [i.opname for i in dis.get_instructions(f)]
    assert f(lambda: Recording({"a": 10, "b": 20})) == 30
    assert plans[0].mode == frames.JUMP  # jumped, not raised
    fused = next(i.offset for i in dis.get_instructions(f) if i.opname == "LOAD_FAST_LOAD_FAST")
    live = f.__code__._co_code_adaptive  # what the interpreter executes
    assert live[fused] == dis.opmap["JUMP_FORWARD"]
    with pytest.raises(UnboundLocalError, match="'b'"):
        f(lambda: SkipOnly({"a": 10}))
    assert f(contextlib.nullcontext) == 3  # the inline path runs through the redirect
