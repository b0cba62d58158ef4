"""The deferred-body API (`Tracer.defer()` -> `DeferredBody`): a captured body run later.

References are the same statements run inline (or a plain Python function doing what the
body does); the deferred run must give what inline gives.
"""

import gc
import pickle
import sys
import threading
import types
import weakref

import pytest

from interlace import InterlaceError, Tracer, save
from interlace.tracing import Backend, DeferredBody
from interlace.tracing.save import TraceState


class Keep(Backend):
    """A backend that runs nothing now: it keeps `tracer.defer()` for later."""

    def __init__(self):
        self.bodies = []

    def __call__(self, tracer):
        self.bodies.append(tracer.defer())


class RunPush(Backend):
    """Defer, run at once on another thread, push: what an interleaving backend does."""

    def __call__(self, tracer):
        body = tracer.defer()
        box = {}
        thread = threading.Thread(target=lambda: box.update(values=body.run()))
        thread.start()
        thread.join()
        box["pushed"] = body.push(box["values"])
        tracer.box = box


# -- binding: names are bound when the block exits ---------------------------------------------
def test_a_loop_variable_keeps_each_iterations_value():
    keep = Keep()
    seen = []
    for i in range(3):
        with Tracer(backend=keep):
            seen.append((i, i * 10))
    assert seen == []  # nothing ran yet
    for body in keep.bodies:
        body.run()
    assert seen == [(i, i * 10) for i in range(3)]  # what the loop does inline


def test_names_are_bound_to_objects_not_copied():
    keep = Keep()
    items = [1]
    with Tracer(backend=keep):
        items.append(len(items))
    items.append(99)  # the caller keeps using the same list
    keep.bodies[0].run()
    inline = [1]
    inline.append(99)
    inline.append(len(inline))
    assert items == inline


def test_rebinding_a_name_after_the_block_does_not_reach_the_body():
    keep = Keep()
    scale = 2
    with Tracer(backend=keep):
        result = save(scale * 21)
    scale = 1000  # noqa: F841 - the body was bound to the earlier value
    values = keep.bodies[0].run()
    assert values["result"] == 42 and keep.bodies[0].namespace == {"scale": 2}


def test_body_keeps_only_the_names_it_mentions_not_the_callers_frame():
    class Heavy:
        pass

    keep = Keep()

    def caller():
        heavy = Heavy()
        used = 3
        with Tracer(backend=keep):
            doubled = save(used * 2)  # noqa: F841
        return weakref.ref(heavy)

    ref = caller()
    gc.collect()
    assert ref() is None  # the deferred body does not keep the caller's other locals alive
    assert keep.bodies[0].namespace == {"used": 3}
    assert keep.bodies[0].run()["doubled"] == 6


# -- run: save state, threads, namespaces, globals --------------------------------------------
def test_run_on_another_thread_saves_into_this_trace_and_push_writes_back():
    def f(cm):
        base = 5
        with cm() as tr:
            kept = save([base])
            dropped = [base]  # noqa: F841 - not saved: not pushed
        return kept, locals().get("dropped"), tr

    kept, dropped, tr = f(lambda: Tracer(backend=RunPush()))
    assert (kept, dropped) == ([5], None)
    assert tr.box["pushed"] == {"kept": [5]}


def test_nested_push_writes_every_assigned_name():
    log = []

    def outer():
        with Tracer():
            with Tracer(backend=RunPush()) as inner:
                a = 1
                b = save(2)
            log.append((a, b, inner))

    outer()
    inner = log[0][2]
    assert log[0][:2] == (1, 2)  # inline, both names are bound after the inner block
    assert inner.box["pushed"] == {"a": 1, "b": 2}


def test_results_are_the_saved_names_at_top_level():
    keep = Keep()
    with Tracer(backend=keep):
        x = save(object())  # noqa: F841
        y = object()  # noqa: F841
    body = keep.bodies[0]
    values = body.run()
    assert body.results(values) == {"x": values["x"]}


def test_push_after_the_block_ended_names_the_block():
    keep = Keep()
    with Tracer(backend=keep):
        z = save(1)  # noqa: F841
    body = keep.bodies[0]
    with pytest.raises(InterlaceError, match=r"test_deferred\.py:\d+: push\(\) after the with block ended"):
        body.push(body.run())
    assert body.push({}) == {}  # nothing to write: nothing to complain about


def test_a_fresh_state_makes_a_run_its_own_trace():
    class PerItem(Backend):
        def __call__(self, tracer):
            tracer.runs = []
            for item in (1, 2):
                body = tracer.defer({"item": item}, state=TraceState(None))
                values = body.run()
                tracer.runs.append(body.results(values))

    with Tracer(backend=PerItem()) as tr:
        got = save(item * 10)  # noqa: F821 - bound by the backend's namespace
        other = item  # noqa: F841, F821
    assert tr.runs == [{"got": 10}, {"got": 20}]


def test_run_with_a_namespace_lacking_a_local_raises_as_inline():
    keep = Keep()

    def f(cm):
        value = 1
        with cm():
            out = save(value + 1)  # noqa: F841
        return locals().get("out")

    f(lambda: Tracer(backend=keep))
    with pytest.raises(UnboundLocalError, match="value"):
        keep.bodies[0].run({})

    def inline():
        if False:
            value = 1
        return value + 1  # noqa: F821

    with pytest.raises(UnboundLocalError, match="value"):
        inline()


class Lazy(dict):
    """A globals mapping that computes a name on demand (as invokes' shared variables do)."""

    def __init__(self, base, extra):
        super().__init__()
        self.base = base
        self.extra = extra

    def __missing__(self, name):
        if name in self.extra:
            return self.extra[name]
        return self.base[name]  # KeyError for builtins: Python looks there next


def test_reads_as_globals_looks_unbound_reads_up_in_the_run_globals():
    keep = Keep()

    def f():
        if False:
            later = 0  # a local of f(), unbound when the block runs
        with Tracer(backend=keep):
            got = save(later + len("ab"))  # noqa: F841
        return None

    f()
    body = keep.bodies[0]
    with pytest.raises(UnboundLocalError, match="later"):
        body.run()  # as inline: `later` is an unbound local
    values = body.run(globals=Lazy(body.globals, {"later": 40}), reads_as_globals=True)

    def reference():  # the same expression with `later` as a global lookup
        return later + len("ab")  # noqa: F821

    lazy = Lazy(globals(), {"later": 40})
    assert values["got"] == type(reference)(reference.__code__, lazy)() == 42


def test_reads_as_globals_keeps_assigned_names_local():
    keep = Keep()

    def f():
        if False:
            total = 0
        with Tracer(backend=keep):
            total += 1  # noqa: F821 - reads the unbound local, as inline
        return None

    f()
    body = keep.bodies[0]
    with pytest.raises(UnboundLocalError, match="total"):
        body.run(globals=Lazy(body.globals, {"total": 1}), reads_as_globals=True)


# -- locals_at and paused_values ---------------------------------------------------------------
class Stop(Exception):
    pass


def test_locals_at_is_where_the_signal_left_the_body():
    keep = Keep()

    def halt():
        raise Stop

    def f(cm):
        start = 1
        with cm():
            a = start + 1
            halt()
            b = 3  # noqa: F841 - never reached
        return None

    f(lambda: Tracer(backend=keep))
    body = keep.bodies[0]
    with pytest.raises(Stop) as info:
        body.run()

    def inline(start, halt):  # the same statements, inline, with the same names bound
        a = start + 1  # noqa: F841
        halt()
        b = 3  # noqa: F841

    with pytest.raises(Stop) as reference:
        inline(1, halt)
    expected = dict(reference.value.__traceback__.tb_next.tb_frame.f_locals)
    assert body.locals_at(info.value) == expected == {"start": 1, "halt": halt, "a": 2}
    assert body.locals_at(Stop()) == {}  # no traceback through the body


def test_paused_values_are_the_names_rebound_since_entry():
    keep = Keep()
    seen = []

    def probe():  # runs inside the body, as a mediator's wait would
        seen.append(keep.bodies[0].paused_values(sys._getframe()))

    def f():
        a, b = [1], [2]
        with Tracer(backend=keep):
            a = [10]
            c = 3  # noqa: F841
            probe()
            b = [20]  # noqa: F841
        return None

    f()
    body = keep.bodies[0]
    assert body.paused_values(sys._getframe()) is None  # not started: no frame of its own
    body.run()
    assert seen == [{"a": [10], "c": 3}]  # `b` still holds the caller's value: not rebound
    assert body.paused_values(sys._getframe()) is None  # this stack has no body frame


def test_paused_values_in_a_greenlet():
    greenlet = pytest.importorskip("greenlet")
    keep = Keep()

    def f():
        n = 0
        with Tracer(backend=keep):
            n = n + 1
            greenlet.getcurrent().parent.switch()
            n = n + 1
        return None

    f()
    body = keep.bodies[0]
    worker = greenlet.greenlet(body.run)
    worker.switch()
    assert body.paused_values(worker.gr_frame) == {"n": 1}
    assert worker.switch()["n"] == 2


# -- the subclass steps are honoured by a deferred run -----------------------------------------
def test_deferred_run_uses_the_subclass_build_and_compile():
    calls = []

    class Steps(Tracer):
        def build(self, node):
            calls.append("build")
            return super().build(node)

        def compile(self, module, frame):
            calls.append("compile")
            return super().compile(module, frame)

    keep = Keep()

    def f():
        word = "x"
        with Steps(backend=keep):
            out = save(word * 2)  # noqa: F841
        return None

    f()
    calls.clear()
    body = keep.bodies[0]
    assert body.run()["out"] == "xx"
    body.run(globals=Lazy(body.globals, {}), reads_as_globals=True)  # another variant
    assert calls == ["compile"]  # built once at capture, compiled once per variant


def test_a_rebuilt_tracer_defers_with_a_namespace_only():
    keep = Keep()
    base = 7
    with Tracer("payload", backend=keep) as tracer:
        total = save([base + i for i in range(2)])  # noqa: F841
    clone = pickle.loads(pickle.dumps(tracer))
    with pytest.raises(InterlaceError, match="pass `namespace=`"):
        clone.defer()
    body = clone.defer({"base": 100, "range": range, "save": save})
    assert body.globals is None and isinstance(body, DeferredBody)
    assert body.run()["total"] == [100, 101]


def test_defer_before_enter_is_an_error():
    with pytest.raises(InterlaceError, match="call it from the backend"):
        Tracer().defer()


def test_at_module_level_reads_stay_live_globals_and_assignments_are_bound(tmp_path):
    path = tmp_path / "mod_deferred.py"
    path.write_text(
        "from interlace import Backend, Tracer, save\n"
        "class Keep(Backend):\n"
        "    bodies = []\n"
        "    def __call__(self, tracer):\n"
        "        self.bodies.append(tracer.defer())\n"
        "base = 1\n"
        "count = 10\n"
        "with Tracer(backend=Keep()):\n"
        "    count = count + base\n"
        "    def read_base():\n"
        "        return base\n"
        "base = 2\n"
        "count = 20\n"
    )
    namespace = {"__name__": "mod_deferred"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    (body,) = namespace["Keep"].bodies
    assert body.namespace == {"count": 10}  # the assigned name, bound at defer()
    values = body.run()
    # inline at the end of the module: `base` is read when the statement runs (2), and a
    # function defined there reads the live global
    assert values["count"] == 10 + 2
    namespace["base"] = 3
    assert values["read_base"]() == 3


# -- the subclass steps contract ---------------------------------------------------------------
def test_each_overridden_step_is_honoured():
    calls = []

    class Steps(Tracer):
        def parse(self, source, lineno):
            calls.append(("parse", lineno))
            return super().parse(source, lineno)

        def build(self, node):
            calls.append(("build", node.lineno))
            return super().build(node)

        def compile(self, module, frame):
            calls.append(("compile", frame.f_code.co_name))
            return super().compile(module, frame)

        def execute(self, code):
            calls.append(("execute", code.co_varnames[: code.co_argcount - 1]))
            super().execute(code)

    def f(cm):
        seed = 3
        with cm() as tracer:
            grown = save(seed + 1)
        return grown, tracer

    grown, tracer = f(Steps)
    line = tracer.block.lineno
    assert grown == f(lambda: _Inline())[0] == 4
    assert calls == [("parse", line), ("build", line), ("compile", "f"), ("execute", ("seed",))]
    calls.clear()
    assert f(Steps)[0] == 4 and calls == [("execute", ("seed",))]  # capture is memoised


class _Inline:
    """The reference: the same block run inline."""

    def __enter__(self):
        from interlace.tracing.save import _CURRENT, enter_body

        self.token = enter_body(TraceState(_CURRENT.get()))
        return self

    def __exit__(self, *exc):
        from interlace.tracing.save import exit_body

        exit_body(self.token)
        return False


# -- the warm site: the body function found again, for the same names and globals only -----
class RunNow(Backend):
    """Defer, run and push at once (the interleaving backend's order, on one thread)."""

    def __call__(self, tracer):
        body = tracer.defer()
        body.push(body.run())


def _reads_y(bind):
    if bind:
        y = 5
    with Tracer(backend=RunNow()):
        h = -1
        h = save(y) if "y" in locals() else save(h)
    return h


def test_a_site_whose_bound_names_change_between_traces_runs_the_body_of_those_names():
    def inline(bind):  # the reference: the same statements, run inline
        if bind:
            y = 5
        h = -1
        h = y if "y" in locals() else h
        return h

    runs = [True, False, True, False]
    assert [_reads_y(bind) for bind in runs] == [inline(bind) for bind in runs] == [5, -1, 5, -1]


G = "module"


def _reads_global():
    with Tracer(backend=RunNow()):
        h = save(G)
    return h


def test_one_site_run_with_other_globals_reads_those_globals():
    other = types.FunctionType(_reads_global.__code__, {**globals(), "G": "other"})
    assert [_reads_global(), other(), _reads_global(), other()] == ["module", "other", "module", "other"]


def test_call_bound_calls_with_the_names_values_in_order():
    from interlace._native import frames

    class Computed(dict):
        def __missing__(self, name):
            return name.upper()

    def f(a, b):
        return a, b

    assert frames.call_bound(f, {"b": 2, "a": 1}, ("a", "b")) == (1, 2)
    assert frames.call_bound(f, Computed(a=1), ("a", "b")) == (1, "B")  # the mapping's own lookup
    assert frames.call_bound(lambda: 0, {}, ()) == 0
    many = tuple(f"n{k}" for k in range(12))  # more than fit on the compiled helper's stack
    assert frames.call_bound(lambda *args: args, {name: k for k, name in enumerate(many)}, many) == tuple(range(12))
    with pytest.raises(KeyError, match="b"):
        frames.call_bound(f, {"a": 1}, ("a", "b"))


def test_pick_keeps_the_saved_values_by_identity_or_all_of_them():
    from interlace._native import frames

    kept, equal = [1], [1]
    values = {"a": kept, "b": equal, "c": 3}
    names = frozenset({"a", "b", "d"})
    assert frames.pick(values, names, {id(kept): kept}) == {"a": kept}
    assert frames.pick(values, names, None) == {"a": kept, "b": equal}
    assert frames.pick(values, names) == {"a": kept, "b": equal}
    assert frames.pick(values, ("c", "a"), {}) == {}


def test_a_deferred_body_in_a_generator_and_a_coroutine_binds_and_writes_back_their_locals():
    import asyncio

    def gen(x):
        cell = x + 1
        with Tracer(backend=RunNow()):
            h = save(x * 3 + cell)
        yield h
        yield (lambda: cell)()

    async def coro(x):
        with Tracer(backend=RunNow()):
            h = save(x * 3)
        await asyncio.sleep(0)
        return h

    def inline(x):  # the reference: the same statements, inline
        cell = x + 1
        return [x * 3 + cell, cell]

    assert list(gen(2)) == inline(2) == [9, 3]
    assert asyncio.run(coro(2)) == 6
