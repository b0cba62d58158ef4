"""Every with shape docs/skip.md discusses, skipped and run by a backend.

Each block is written once as a function of the context-manager class and run with
`Tracer` and with the inline reference (`Inline`, tests/tracing/conftest.py): the results
must be equal, and a body must never run twice (bodies count their runs in `RUNS`).
Shapes the pure-Python twin refuses are `native_only`; the twin's refusals are checked in
test_skip_refusals.py.
"""

import asyncio
import contextlib
import sys
import threading

import pytest

from interlace import Backend, Tracer, save

RUNS = []


def ran(tag):
    RUNS.append(tag)
    return tag


@pytest.fixture(autouse=True)
def _clear_runs():
    RUNS.clear()
    yield
    RUNS.clear()


def same(fn, inline, *args):
    """fn(Tracer) == fn(Inline), each body having run exactly as often as inline."""
    RUNS.clear()
    expected = fn(inline, *args)
    inline_runs = list(RUNS)
    RUNS.clear()
    got = fn(Tracer, *args)
    assert got == expected
    assert RUNS == inline_runs
    return got


# -- the commonest shape and unbound reads -------------------------------------------------

def read_after(T):
    with T():
        h = save(ran(3) * 2)
    return h


def test_name_bound_in_body_read_after_block(inline):
    assert same(read_after, inline) == 6


def two_names(T):
    with T():
        a = save(ran(1))
        b = save(2)
    return a + b, (a, b)


def test_two_names_read_together_after_block(inline):
    # 3.13 fuses `a + b` into LOAD_FAST_LOAD_FAST, which has no checked form
    assert same(two_names, inline) == (3, (1, 2))


def unsaved(T):
    with T():
        h = ran(1)
    return h


@pytest.mark.parametrize("rounds", [1, 3])
def test_unsaved_name_read_after_block_raises_unbound_local(rounds):
    for _ in range(rounds):
        with pytest.raises(UnboundLocalError, match="'h'"):
            unsaved(Tracer)
    assert RUNS == [1] * rounds


def unsaved_fused(T):
    with T():
        a = ran(1)
        b = 2
    return a + b


def test_unsaved_pair_read_after_block_raises_unbound_local():
    with pytest.raises(UnboundLocalError, match="'a'"):
        unsaved_fused(Tracer)


def unsaved_in_loop(T, n):
    total = 0
    for i in range(n):
        with T():
            h = ran(i)
        if i % 2:
            continue
        total += 1
    return total, h


def test_unsaved_name_in_a_loop_raises_unbound_local():
    with pytest.raises(UnboundLocalError, match="'h'"):
        unsaved_in_loop(Tracer, 3)
    assert RUNS == [0, 1, 2]


def alternating(T, saved):
    with T():
        h = ran(7)
        if saved:
            save(h)
    return h


def test_same_site_saved_then_unsaved_then_saved():
    assert alternating(Tracer, True) == 7
    with pytest.raises(UnboundLocalError):
        alternating(Tracer, False)
    assert alternating(Tracer, True) == 7


# -- body position shapes ------------------------------------------------------------------

def same_line(T):
    with T(): h = save(ran(5))  # noqa: E701
    return h


def same_line_as(T):
    with T() as t: y = save(ran(t is not None))  # noqa: E701
    return y


@pytest.mark.native_only
def test_body_on_the_with_line(inline):
    assert same(same_line, inline) == 5
    assert same(same_line_as, inline) is True


def try_first(T, exc):
    with T():
        try:
            ran("try")
            if exc:
                raise exc("boom")
            h = save(1)
        except ValueError:
            h = save(2)
        finally:
            ran("finally")
    return h


def try_bare(T):
    with T():
        try:
            h = save(ran(4))
        except:  # noqa: E722
            h = save(0)
    return h


@pytest.mark.native_only
def test_try_first_body(inline):
    assert same(try_first, inline, None) == 1
    assert same(try_first, inline, ValueError) == 2
    assert same(try_bare, inline) == 4
    with pytest.raises(KeyError):
        try_first(Tracer, KeyError)


def multi_line_header(T):
    with (
        T()
        as t
    ):
        h = save(ran(t is not None))
    return h


def parenthesised_items(T):
    with (T() as t,):
        h = save(ran(1))
    return h


def test_parenthesised_and_multi_line_headers(inline):
    assert same(multi_line_header, inline) is True
    assert same(parenthesised_items, inline) == 1


class Box:
    pass


def as_targets(T):
    box = Box()
    d = {}
    with T() as t:
        a = save(ran(t is not None))
    with T() as box.attr:
        b = save(ran(box.attr is not None))
    with T() as d["k"]:
        c = save(ran(d["k"] is not None))
    with T() as (e, f):  # noqa: F841
        g = save(ran(2))
    with T():
        i = save(ran(3))
    return a, b, c, g, i


def test_every_as_target_form(inline):
    class T(Tracer):
        def __enter__(self):
            value = super().__enter__()
            return _Pairish(value)

    def f(cm):
        return as_targets(cm)

    class I(inline):
        def __enter__(self):
            return _Pairish(super().__enter__())

    RUNS.clear()
    expected = f(I)
    inline_runs = list(RUNS)
    RUNS.clear()
    assert f(T) == expected == (True, True, True, 2, 3)
    assert RUNS == inline_runs


class _Pairish(tuple):
    """Unpacks to two items, so one object serves every target form."""

    def __new__(cls, value):
        return super().__new__(cls, (value, value))


def a_then_t(T, A):
    with A(), T():
        h = save(ran(1))
    return h


def t_then_b(T, B):
    with T(), B():
        h = save(ran(2))
    return h


class Plain:
    def __init__(self):
        self.events = []

    def __enter__(self):
        RUNS.append("enter")
        return self

    def __exit__(self, *exc):
        RUNS.append("exit")
        return False


def test_other_context_manager_before_the_tracer(inline):
    assert same(a_then_t, inline, Plain) == 1


@pytest.mark.native_only
def test_other_context_manager_after_the_tracer(inline):
    assert same(t_then_b, inline, Plain) == 2


def nested_withs(T):
    with T():
        with T():
            a = save(ran(1))
        b = save(a + 1)
    return a, b


def test_nested_traces(inline):
    assert same(nested_withs, inline) == (1, 2)


def inside_except(T):
    try:
        raise KeyError("x")
    except KeyError as error:
        with T():
            h = save(ran(repr(error)))
    return h


def test_with_inside_except(inline):
    assert same(inside_except, inline) == "KeyError('x')"


# -- scopes ----------------------------------------------------------------------------------

def looped(T, n):
    out = []
    for i in range(n):
        with T():
            h = save(i * 2)
        out.append(h)
    return sum(out)


def test_ten_thousand_iterations_survive_quickening():
    assert looped(Tracer, 10_000) == sum(i * 2 for i in range(10_000))


def gen(T):
    for i in range(3):
        with T():
            h = save(ran(i))
        yield h


def test_generator(inline):
    RUNS.clear()
    assert list(gen(Tracer)) == list(gen(inline)) == [0, 1, 2]


def closure(T):
    x = 1

    def reader():
        return x

    with T():
        x = save(ran(41) + 1)
    return reader(), x


def test_closure_cells(inline):
    assert same(closure, inline) == (42, 42)


def test_class_body():
    class C:
        with Tracer():
            h = save(ran(5))
        k = h + 1

    assert (C.h, C.k) == (5, 6)


def test_module_level(tmp_path):
    path = tmp_path / "modlevel.py"
    path.write_text(
        "from interlace import Tracer, save\n"
        "with Tracer():\n"
        "    h = save(40)\n"
        "result = h + 2\n"
    )
    import runpy

    namespace = runpy.run_path(str(path))
    assert namespace["result"] == 42


def test_two_threads_share_a_site_one_with_a_tracer():
    barrier = threading.Barrier(2)
    results = {}

    def site(cm, tag, n):
        out = 0
        for i in range(n):
            with cm():
                h = save(i) if cm is Tracer else i
                if cm is not Tracer:
                    RUNS.append(tag)
            out += h
        return out

    def worker(cm, tag):
        barrier.wait()
        results[tag] = site(cm, tag, 2000)

    threads = [
        threading.Thread(target=worker, args=(Tracer, "t")),
        threading.Thread(target=worker, args=(Plain2, "p")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"t": sum(range(2000)), "p": sum(range(2000))}
    assert RUNS.count("p") == 2000


class Plain2:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def exit_reenters(n):
    class Recurse(Backend):
        def __call__(self, tracer):
            Backend.__call__(self, tracer)
            if n:
                out.append(exit_reenters(n - 1))

    out = []
    with Tracer(backend=Recurse()):
        h = save(ran(n))
    return h, out


def test_exit_reenters_the_same_site():
    assert exit_reenters(2) == (2, [(1, [(0, [])])])
    assert RUNS == [2, 1, 0]


class Raising:
    def __setattr__(self, name, value):
        raise AttributeError(f"no {name} here")


def as_binding_raises(T):
    obj = Raising()
    with T() as obj.attr:
        ran("body")
    return "after"


def test_exception_during_the_as_binding_is_the_users():
    before = sys.gettrace()
    with pytest.raises(AttributeError, match="no attr here"):
        as_binding_raises(Tracer)
    assert RUNS == []
    assert sys.gettrace() is before
    assert read_after(Tracer) == 6  # the next trace works


def test_body_that_always_raises(inline):
    def f(T):
        with T():
            ran(1)
            raise LookupError("from the body")

    with pytest.raises(LookupError, match="from the body"):
        f(Tracer)
    assert RUNS == [1]


def test_sync_with_inside_a_coroutine():
    async def f():
        with Tracer():
            h = save(ran(9))
        await asyncio.sleep(0)
        return h

    assert asyncio.run(f()) == 9
    assert RUNS == [9]


def fused_binding(T):
    with T() as t:
        y = t  # noqa: F841 - 3.11/3.12 quicken `STORE_FAST t; LOAD_FAST t` into one pair
        h = save(ran(1))
    return h


def test_as_binding_followed_by_a_read_of_it(inline):
    for _ in range(3):
        assert same(fused_binding, inline) == 1


def load(tmp_path, name, source):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text("from interlace import save\n" + source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_600_statement_caller(tmp_path):
    source = (
        "def big(T):\n"
        + "".join(f"    v{i} = {i}\n" for i in range(300))
        + "    with T():\n        h = save(v1 + v299)\n"
        + "".join(f"    w{i} = h + {i}\n" for i in range(300))
        + "    return w299\n"
    )
    module = load(tmp_path, "bigcaller", source)
    assert [module.big(Tracer) for _ in range(3)] == [599] * 3


def test_locals_beyond_256_need_extended_args(tmp_path):
    source = (
        "def many(T):\n"
        + "".join(f"    a{i} = {i}\n" for i in range(300))
        + "    with T():\n        z = save(a299)\n        y = save(z + 1)\n"
        + "    return z + y + a0\n"
    )
    module = load(tmp_path, "manylocals", source)
    assert [module.many(Tracer) for _ in range(3)] == [599] * 3


def test_identical_functions_in_two_files(tmp_path):
    source = "def f(T, k):\n    with T():\n        h = save(k * 2)\n    return h\n"
    one = load(tmp_path, "twin_one", source)
    two = load(tmp_path, "twin_two", source)
    assert [one.f(Tracer, 1), two.f(Tracer, 2), one.f(Tracer, 3), two.f(Tracer, 4)] == [2, 4, 6, 8]


def hot_shapes(T, n):
    out = 0
    for i in range(n):
        with T() as t:
            y = t  # noqa: F841 - binding then a read of it: a quickened pair on 3.11/3.12
            a = save(i)
            b = save(1)
        out += a + b
        with T():
            c = save(2)
        out += c
    return out


def test_hot_loop_over_quickened_shapes(inline):
    assert same(hot_shapes, inline, 1000) == sum(range(1000)) + 3000


@pytest.mark.native_only
def test_hot_loop_over_same_line_and_try_first_bodies(inline):
    def f(T, n):
        out = 0
        for i in range(n):
            with T(): a = save(i)  # noqa: E701
            with T():
                try:
                    b = save(a + 1)
                except KeyError:
                    b = 0
            out += b
        return out

    assert same(f, inline, 1000) == sum(range(1, 1001))


def try_first_reraising(T, fail):
    with T():
        try:
            if fail:
                raise KeyError("k")
            h = save(ran(1))
        except KeyError as exc:
            ran("except")
            raise ValueError("converted") from exc
        except BaseException:
            raise
    return h


@pytest.mark.native_only
def test_try_first_body_whose_handlers_always_reraise(inline):
    # 3.10 leaves the named handler's POP_BLOCK out of the code: the exit search must
    # follow the control flow, not count blocks linearly
    assert same(try_first_reraising, inline, False) == 1
    with pytest.raises(ValueError, match="converted"):
        try_first_reraising(Tracer, True)


def test_four_threads_trace_the_same_site_at_once():
    barrier = threading.Barrier(4)
    results = {}

    def site(k, n):
        total = 0
        for i in range(n):
            with Tracer():
                h = save(i * k)
            total += h
        return total

    def worker(k):
        barrier.wait()
        results[k] = site(k, 500)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: k * sum(range(500)) for k in range(1, 5)}


# -- shapes from issue 7 item 6 (each failed before its fix) ---------------------------------

def two_tracers(T):
    with T(), T():
        h = save(ran(1))
    return h


def three_tracers_over_lines(T):
    with (T(),
          T() as t,
          T()):
        h = save(ran(t is not None))
    return h


@pytest.mark.native_only
def test_two_and_three_tracers_in_one_with(inline):
    # The first tracer's body is `with <later items>: body`; its compiled body enters them.
    # 3.10 has no columns: it used to find the first item again there (endless recursion).
    for _ in range(2):
        assert same(two_tracers, inline) == 1
        assert same(three_tracers_over_lines, inline) is True


def test_a_with_far_from_its_handler_needs_an_extended_arg(tmp_path):
    # 3.10's f_lasti then points at the EXTENDED_ARG before SETUP_WITH (it was refused as
    # "not used as a with block"), as do nested ones whose inner `with` is the first
    # statement of the outer body.
    chain = "".join("            a = a + 1\n" for _ in range(100))
    source = (
        "def nested_first(T, x):\n"
        "    with T():\n"
        "        with T():\n"
        "            a = x\n" + chain + "            a = save(a)\n"
        "    return a\n"
        "def plain(T, x):\n"
        "    with T():\n"
        "        a = x\n" + chain.replace("    a =", "a =") + "        a = save(a)\n"
        "    return a\n"
    )
    module = load(tmp_path, "farhandler", source)
    for function in (module.nested_first, module.plain):
        assert [function(Tracer, k) for k in range(3)] == [100, 101, 102]


def same_line_raising(T, x):
    try:
        with T(): ran(x); raise KeyError(x)  # noqa: E701, E702
    except KeyError as error:
        return error.args


@pytest.mark.native_only
def test_a_same_line_body_that_always_raises(inline):
    # no normal exit exists: the skip raises at the body start's instruction event
    for k in range(3):
        assert same(same_line_raising, inline, k) == (k,)


@pytest.mark.native_only
def test_try_first_body_with_a_fused_read_after_the_block(tmp_path):
    # 3.13 reads `a + b` right after the block with one unchecked LOAD_FAST_LOAD_FAST (the
    # compiler knows the body binds both). The handler's checked copy of `return a + b` lies
    # past the long rest of the function, over 255 units away, so the read cannot be
    # redirected there, and a `try`-first body cannot be skipped by raising. This used to be
    # refused; the fused read is now guarded: an unbound local raises UnboundLocalError there,
    # as a checked read would (without the guard: a crash), and bound ones are read as usual.
    rest = "".join(f"    z = z * 3 + {i}\n" for i in range(90))
    source = (
        "def f(T, saved, flag=True):\n"
        "    z = 0\n"
        "    if flag:\n"
        "        with T():\n"
        "            try:\n"
        "                z = 1\n"
        "            except ValueError:\n"
        "                pass\n"
        "            a = 1\n"
        "            b = 2\n"
        "            if saved:\n"
        "                save(a)\n"
        "                save(b)\n"
        "        return a + b\n" + rest + "    return z\n"
    )
    module = load(tmp_path, "fusedtail", source)
    for _ in range(2):
        assert module.f(Tracer, True) == 3
        with pytest.raises(UnboundLocalError, match="'a'"):
            module.f(Tracer, False)
    assert module.f(contextlib.nullcontext, False) == 3  # inline, through the guard
    assert module.f(Tracer, True, flag=False) == module.f(contextlib.nullcontext, True, flag=False)
