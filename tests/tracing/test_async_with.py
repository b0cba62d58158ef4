"""`async with Tracer():` in a coroutine works like `with`: same results as the block inline.

`__aenter__`/`__aexit__` do the work of `__enter__`/`__exit__` at once and return an
awaitable that is already done, so the coroutine never suspends between arming the skip and
the body start. Each block is written once as a coroutine of the context-manager class and
run traced and with an inline reference (`AsyncInline`); coroutines are driven by
`asyncio.run` (a real event loop) or by hand.
"""

import asyncio
import contextlib
import os
import traceback

import pytest

import interlace
from interlace import Backend, Tracer, UnsupportedBlockError, save
from interlace._native import frames

from .conftest import Inline

RUNS = []


def ran(tag):
    RUNS.append(tag)
    return tag


class AsyncInline(Inline):
    """Reference: the body runs inline, `save` usable, nothing pushed."""

    async def __aenter__(self):
        return self.__enter__()

    async def __aexit__(self, *exc):
        return self.__exit__(*exc)


@pytest.fixture(autouse=True)
def _clean():
    RUNS.clear()
    yield
    RUNS.clear()
    assert frames.armed_count() == 0


def same(coroutine_function, *args):
    """The coroutine with Tracer == with AsyncInline, each body run as often as inline."""
    RUNS.clear()
    expected = asyncio.run(coroutine_function(AsyncInline, *args))
    inline_runs = list(RUNS)
    RUNS.clear()
    got = asyncio.run(coroutine_function(Tracer, *args))
    assert got == expected
    assert RUNS == inline_runs
    return got


async def plain(T, x):
    base = x + 1
    await asyncio.sleep(0)
    async with T():
        h = save(ran(base * 2))
        squares = save([i * base for i in range(3)])
    await asyncio.sleep(0)
    return h, squares


async def as_target(T):
    async with T() as tr:
        kind = save(ran(type(tr).__name__))
    return kind, type(tr).__name__


async def in_a_loop(T, n):
    out = []
    for i in range(n):
        async with T():
            h = save(ran(i * 10))
        out.append(h)
        await asyncio.sleep(0)
    return out


async def nested(T):
    async with T():
        with T():
            a = ran(1)
        b = save(a + 1)
    return b


class Plain:
    async def __aenter__(self):
        RUNS.append("enter")
        return self

    async def __aexit__(self, *exc):
        RUNS.append("exit")
        return False


async def other_item_first(T):
    async with Plain(), T():
        h = save(ran(3))
    return h


def test_the_native_path_has_c_async_methods_and_the_twin_the_python_ones():
    from interlace.tracing import tracer as tracer_module

    if frames.COMPILED:
        assert not hasattr(Tracer.__aenter__, "__code__")
        assert not hasattr(Tracer.__aexit__, "__code__")
    else:
        assert Tracer.__aenter__ is tracer_module._policy_aenter
        assert Tracer.__aexit__ is tracer_module._policy_aexit


def test_async_with_runs_the_body_once_and_pushes_saved_values():
    assert same(plain, 2) == (6, [0, 3, 6])


def test_as_target_is_what_aenter_awaits_to():
    got = asyncio.run(as_target(Tracer))
    assert got == ("Tracer", "Tracer")
    assert RUNS == ["Tracer"]


def test_a_warm_async_site_in_a_loop():
    assert same(in_a_loop, 5) == [0, 10, 20, 30, 40]


def test_a_sync_trace_nested_in_an_async_one():
    assert same(nested) == 2


def test_another_async_context_manager_before_the_tracer():
    assert same(other_item_first) == 3


def test_aenter_and_aexit_return_done_awaitables():
    tracer = Tracer()

    async def f():
        async with tracer as got:
            x = save(ran(1))  # noqa: F841
        return got

    assert asyncio.run(f()) is tracer


def test_driven_by_hand_it_never_suspends():
    async def f():
        async with Tracer():
            h = save(ran(7))
        return h

    coroutine = f()
    with pytest.raises(StopIteration) as info:
        coroutine.send(None)  # one step: nothing inside awaits anything
    assert info.value.value == 7


def test_unsaved_name_read_after_the_block_raises_unbound_local():
    async def f():
        async with Tracer():
            h = ran(1)
        return h

    for _ in range(2):
        with pytest.raises(UnboundLocalError, match="'h'"):
            asyncio.run(f())
    assert RUNS == [1, 1]


def test_body_error_keeps_its_type_and_the_users_frames_only():
    async def f(x):
        async with Tracer():
            h = save(1 // x)  # noqa: F841

    for _ in range(3):
        with pytest.raises(ZeroDivisionError) as info:
            asyncio.run(f(0))
        frames_ = traceback.extract_tb(info.value.__traceback__)
        assert frames_[-1].name == "f" and "1 // x" in frames_[-1].line
        ours = [fr.name for fr in frames_ if os.sep + "interlace" + os.sep in fr.filename]
        assert ours == ([] if interlace.native else ["__aexit__"])


def test_a_subclass_overriding_enter_works_with_async_with():
    class Sub(Tracer):
        def __enter__(self):
            RUNS.append("sub")
            return super().__enter__()

    async def f():
        async with Sub() as tr:
            h = save(ran(4))
        return h, type(tr).__name__

    assert asyncio.run(f()) == (4, "Sub")
    assert asyncio.run(f()) == (4, "Sub")
    assert RUNS == ["sub", 4, "sub", 4]


def test_a_backend_sees_the_coroutine_frame():
    seen = []

    class Recording(Backend):
        def __call__(self, tracer):
            seen.append(tracer.block.kind)
            super().__call__(tracer)

    async def f():
        async with Tracer(backend=Recording()):
            h = save(ran(5))
        return h

    assert asyncio.run(f()) == 5
    assert seen == ["function"]


def test_the_tracer_before_another_async_item_is_refused_before_anything_runs():
    async def f():
        async with Tracer(), Plain():
            h = save(ran(1))
        return h

    with pytest.raises(UnsupportedBlockError) as info:
        asyncio.run(f())
    message = str(info.value)
    assert f"{__file__}:" in message and "not the last item of this `async with`" in message
    assert "Put the tracer last" in message
    assert RUNS == []


@pytest.mark.native_only
def test_same_line_and_try_first_async_bodies():
    async def same_line(T):
        async with T(): h = save(ran(8))  # noqa: E701
        return h

    async def try_first(T, fail):
        async with T():
            try:
                if fail:
                    raise ValueError("x")
                h = save(ran(1))
            except ValueError:
                h = save(ran(2))
            finally:
                ran("finally")
        return h

    assert same(same_line) == 8
    assert same(try_first, False) == 1
    assert same(try_first, True) == 2


@pytest.mark.skipif(interlace.native, reason="the twin's refusals")
def test_the_twin_refuses_what_it_cannot_skip_in_async_with_too():
    async def same_line():
        async with Tracer(): h = save(ran(8))  # noqa: E701
        return h

    with pytest.raises(UnsupportedBlockError, match="does not start on a line of its own"):
        asyncio.run(same_line())
    assert RUNS == []


def test_nullcontext_reference_agrees():
    """The fuzz test's inline reference (`nullcontext`, `save` = identity) agrees too."""

    async def f(T, save):
        async with T():
            h = save([ran(i) for i in range(3)])
        return h

    assert asyncio.run(f(Tracer, save)) == asyncio.run(f(contextlib.nullcontext, lambda v: v))
