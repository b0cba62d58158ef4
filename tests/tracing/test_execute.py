"""Running a captured body: it sees the caller's locals everywhere, results come back saved.

Each behaviour is checked against the same block run inline (`Inline`, see conftest.py).
"""

import pytest

import interlace
from interlace import Backend, Tracer, save
from interlace.tracing import blocks

from .conftest import Inline

MODULE_CONSTANT = 7


# -- the body sees the caller's locals, from every nested scope ------------------------------
def scopes(cm, a):
    b = a * 2
    items = [1, 2, 3]
    with cm():
        listed = [x * b for x in items].save()
        setted = {x + a for x in items}.save()
        mapped = {x: b for x in items}.save()
        gen = save(list(x + a + b for x in items))
        nested = save([[x * y for y in items if y > a] for x in items])
        lam = save((lambda k: k + a + b)(1))
        deflt = save((lambda k=b: k)())

        def helper(z):
            return z * a + MODULE_CONSTANT

        called = save(helper(3))
        walrus = save([(w := x * a) for x in items])
        last_w = save(w)
    return listed, setted, mapped, gen, nested, lam, deflt, called, walrus, last_w


def test_comprehensions_genexps_lambdas_see_caller_locals():
    assert scopes(Tracer, 2) == scopes(Inline, 2)
    assert scopes(Tracer, 2)[0] == [4, 8, 12]


def augmented(cm, n):
    total = n
    with cm():
        total += 10
        total = save(total)
    return total


def test_augmented_assignment_reads_the_caller_value():
    assert augmented(Tracer, 5) == augmented(Inline, 5) == 15


def test_caller_cells_and_free_variables_are_visible():
    def outer(cm):
        captured = 3

        def inner():
            with cm():
                got = save(captured * 2)
            return got

        cell = 4
        with cm():
            both = save((cell, inner()))
        return both, (lambda: cell)()

    assert outer(Tracer) == outer(Inline) == ((4, 6), 4)


def test_a_caller_cell_assigned_in_the_body_is_seen_by_its_closures():
    def f(cm):
        shared = 1
        read = lambda: shared  # noqa: E731 - makes `shared` a cell of f
        with cm():
            shared = save(shared + 41)
        return read(), shared

    assert f(Tracer) == f(Inline) == (42, 42)


def unbound_read(cm):
    if False:
        late = 1
    with cm():
        x = save(late)  # noqa: F821 - unbound on purpose
    return x


def test_an_unbound_caller_local_stays_unbound_in_the_body():
    with pytest.raises(UnboundLocalError) as inline_error:
        unbound_read(Inline)
    with pytest.raises(UnboundLocalError) as traced:
        unbound_read(Tracer)
    assert "late" in str(traced.value) and "late" in str(inline_error.value)


def later_bound(cm, flag):
    if flag:
        maybe = 1
    with cm():
        got = save(maybe if flag else None)  # noqa: F821
    return got


def test_bound_and_unbound_variants_of_one_site():
    assert later_bound(Tracer, True) == 1
    assert later_bound(Tracer, False) is None
    assert later_bound(Tracer, True) == later_bound(Inline, True)


def test_body_writes_do_not_touch_the_caller_copy_unless_saved():
    def f(cm):
        a = [1]
        b = 1
        with cm():
            a = [2]  # rebinding: unsaved, so the caller keeps its own `a`
            b = save(5)
        return a, b

    assert f(Tracer) == ([1], 5)
    assert f(Inline) == ([2], 5)  # inline would rebind: the documented difference


def test_in_place_mutation_of_caller_objects_is_seen():
    def f(cm):
        seen = []
        with cm():
            seen.append(1)
        return seen

    assert f(Tracer) == f(Inline) == [1]


# -- where results are pushed ---------------------------------------------------------------
def test_function_fast_locals_receive_saved_values(inline):
    def f(cm):
        x = 0
        with cm():
            x = save(41 + 1)
            y = save("y")
        return x, y

    assert f(Tracer) == f(inline) == (42, "y")


def test_unsaved_names_are_not_pushed():
    def f():
        with Tracer():
            h = 1
            kept = save(2)
        return kept, "h" in locals()

    assert f() == (2, False)


def test_class_body_namespace_receives_saved_values():
    class Traced:
        base = 3
        with Tracer():
            attr = save(base * 2)
            other = 5

    assert Traced.attr == 6
    assert not hasattr(Traced, "other")


def test_module_globals_receive_saved_values(tmp_path):
    path = tmp_path / "mod_globals.py"
    path.write_text(
        "from interlace import Tracer, save\n"
        "seed = 4\n"
        "with Tracer():\n"
        "    squares = save([i * seed for i in range(3)])\n"
        "    dropped = 1\n"
    )
    namespace = {"__name__": "mod_globals"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    assert namespace["squares"] == [0, 4, 8]
    assert "dropped" not in namespace


def test_module_level_body_functions_keep_working_after_the_block(tmp_path):
    path = tmp_path / "mod_closure.py"
    path.write_text(
        "from interlace import Tracer, save\n"
        "base = 10\n"
        "with Tracer():\n"
        "    offset = 5\n"
        "    def shifted(v):\n"
        "        return v + offset + base\n"
        "    shifted = save(shifted)\n"
        "    total = save(sum(shifted(i) for i in range(2)))\n"
        "base = 100\n"
        "later = shifted(0)\n"
    )
    namespace = {"__name__": "mod_closure"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    assert namespace["total"] == 31
    assert namespace["later"] == 105  # sees the module's real, current globals
    assert namespace["shifted"].__globals__ is namespace


def test_global_statement_writes_module_globals_at_once():
    global GLOBAL_TARGET
    GLOBAL_TARGET = None

    def f(cm):
        with cm():
            global GLOBAL_TARGET
            GLOBAL_TARGET = "set"

    f(Tracer)
    assert GLOBAL_TARGET == "set"


def test_nonlocal_statement_writes_the_enclosing_cell_when_saved():
    def outer(cm):
        count = 1

        def bump():
            with cm():
                nonlocal count  # function-wide, as if declared at the top of bump()
                count = save(count + 1)
            return count

        bump()
        return count

    assert outer(Tracer) == outer(Inline) == 2


def test_nested_trace_pushes_all_its_locals_to_the_enclosing_body():
    def f(cm):
        with cm():
            base = 2
            with cm():
                inner_unsaved = base + 1
                inner_other = [inner_unsaved]
            outer = save((inner_unsaved, inner_other))
        return outer

    assert f(Tracer) == f(Inline) == (3, [3])


def test_nested_saved_value_reaches_the_outermost_caller():
    def f():
        with Tracer():
            with Tracer():
                deep = save("deep")
        return deep

    assert f() == "deep"


def test_module_level_nested_trace(tmp_path):
    path = tmp_path / "mod_nested.py"
    path.write_text(
        "from interlace import Tracer, save\n"
        "with Tracer():\n"
        "    a = 1\n"
        "    with Tracer():\n"
        "        b = a + 1\n"
        "    c = save(b * 10)\n"
    )
    namespace = {"__name__": "mod_nested"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    assert namespace["c"] == 20
    assert "a" not in namespace and "b" not in namespace


def test_loop_of_traces_and_break_continue_inside_body_loops():
    def f(cm):
        out = []
        for i in range(300):
            with cm():
                acc = 0
                for j in range(5):
                    if j == 3:
                        break
                    if j == 0:
                        continue
                    acc += j * i
                while True:
                    break
                got = save(acc)
            out.append(got)
        return out

    assert f(Tracer) == f(Inline)


def test_generator_caller():
    def gen(cm):
        for i in range(3):
            with cm():
                v = save(i * i)
            yield v

    assert list(gen(Tracer)) == list(gen(Inline)) == [0, 1, 4]


def test_body_defines_functions_and_classes_and_imports():
    def f(cm):
        k = 5
        with cm():
            import math as m

            class Box:
                size = k

            def twice(v):
                return 2 * v

            got = save((m.floor(2.5), Box.size, twice(k)))
        return got

    assert f(Tracer) == f(Inline) == (2, 5, 10)


def test_body_with_try_except_finally_inside():
    def f(cm):
        with cm():
            x = 0
            try:
                raise KeyError("k")
            except KeyError as err:
                name = str(err)
            finally:
                x = 1
            got = save((x, name))
        return got

    assert f(Tracer) == f(Inline)


def test_user_named_locals_does_not_break_the_body():
    def f(cm):
        locals_ = 1  # noqa: F841
        with cm():
            locals = lambda: {"fake": 1}  # noqa: E731, A001
            got = save(locals())
        return got

    assert f(Tracer) == f(Inline) == {"fake": 1}


def test_future_annotations_flag_follows_the_caller():
    from . import _future_caller

    assert _future_caller.annotated(Tracer) == _future_caller.annotated(Inline) == {"x": "Undefined"}


# -- pass-only bodies ---------------------------------------------------------------------------
class CountingBackend(Backend):
    def __init__(self):
        self.calls = 0

    def __call__(self, tracer):
        self.calls += 1
        super().__call__(tracer)


@pytest.mark.parametrize("body", ["pass", '"""doc"""', "...", "pass\n        ...\n        'x'"])
def test_pass_only_body_runs_inline_and_the_backend_still_runs(tmp_path, body):
    path = tmp_path / f"passonly_{abs(hash(body))}.py"
    path.write_text(
        "from interlace import Tracer\n"
        "def f(backend):\n"
        "    with Tracer(backend=backend) as tr:\n"
        f"        {body}\n"
        "    return tr\n"
    )
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    backend = CountingBackend()
    tracer = namespace["f"](backend)
    assert backend.calls == 1
    assert tracer.block.passonly


def test_body_with_only_a_call_is_not_pass_only():
    backend = CountingBackend()
    hits = []
    with Tracer(backend=backend) as tr:
        hits.append(1)
    assert not tr.block.passonly
    assert backend.calls == 1 and hits == [1]


# -- the backend contract -------------------------------------------------------------------
def test_backend_receives_the_tracer_and_may_defer_running_the_body():
    log = []

    class Deferred(Backend):
        def __call__(self, tracer):
            log.append(("before", tracer.block.lineno))
            values = tracer.run_body()
            log.append(("ran", sorted(values)))
            tracer.push_result(values)

    def f():
        with Tracer(backend=Deferred()) as tr:
            v = save(1)
            log.append("body")
        return v, tr

    v, tr = f()
    assert v == 1
    assert log[:2] == [("before", tr.block.lineno), "body"]
    assert log[2][0] == "ran" and {"v", "log"} <= set(log[2][1])


def test_a_backend_that_never_runs_the_body_skips_it():
    ran = []

    class Nothing(Backend):
        def __call__(self, tracer):
            pass

    with Tracer(backend=Nothing()):
        ran.append(1)
    assert ran == []


def test_body_exception_keeps_its_type_and_points_at_the_user_line():
    import traceback

    class Custom(Exception):
        pass

    def f():
        with Tracer():
            x = 1
            if x:
                raise Custom(f"boom {x}")

    with pytest.raises(Custom, match="boom 1") as info:
        f()
    frames = traceback.extract_tb(info.value.__traceback__)
    last = frames[-1]
    assert last.filename == __file__ and last.name == "f" and "raise Custom" in last.line
    internal = [fr for fr in frames if "interlace" + __import__("os").sep + "tracing" in fr.filename]
    # natively none; the twin keeps the one frame that re-raises
    assert [fr.name for fr in internal] == ([] if interlace.native else ["__exit__"])


def test_backend_error_is_reraised_without_interlace_frames():
    import os
    import traceback

    def user_helper():
        raise RuntimeError("from a user helper in the backend")

    class Failing(Backend):
        def __call__(self, tracer):
            user_helper()

    with pytest.raises(RuntimeError, match="user helper") as info:
        with Tracer(backend=Failing()):
            pass
    names = [fr.name for fr in traceback.extract_tb(info.value.__traceback__)]
    assert "user_helper" in names
    assert "__call__" in names  # the backend's own frame is the user's (this file)
    internal = [fr for fr in traceback.extract_tb(info.value.__traceback__) if os.sep + "interlace" + os.sep in fr.filename]
    assert [fr.name for fr in internal] == ([] if interlace.native else ["__exit__"])


def test_body_error_context_is_not_our_skip_signal():
    def f(fail=True):
        with Tracer():
            if fail:
                raise ValueError("plain")

    with pytest.raises(ValueError) as info:
        f()
    context = info.value.__context__
    assert context is None or info.value.__suppress_context__


def test_body_error_keeps_a_real_context():
    def f(again=True):
        with Tracer():
            first = again  # not try-first: the twin refuses those
            try:
                if again:
                    raise KeyError("first")
            except KeyError:
                if again:
                    raise ValueError("second")  # noqa: B904

    with pytest.raises(ValueError) as info:
        f()
    assert isinstance(info.value.__context__, KeyError)


def test_tracebacks_name_the_callers_function():
    def the_callers_name():
        with Tracer():
            {}["missing"]

    with pytest.raises(KeyError) as info:
        the_callers_name()
    assert info.traceback[-1].name == "the_callers_name"
    assert info.traceback[-1].frame.code.raw.co_filename == __file__


def test_body_is_compiled_under_the_user_filename_and_name():
    def named_fn():
        with Tracer() as tr:
            x = save(1)
        return tr, x

    tr, _ = named_fn()
    code = tr.block.function_code(tuple(n for n in tr.block.names if n == "tr"), tr)
    assert code.co_filename == __file__
    assert code.co_name == "named_fn"
    assert code.co_firstlineno == tr.block.lineno


def test_interlace_exports():
    assert interlace.Tracer is Tracer and interlace.Backend is Backend and interlace.save is save
    assert isinstance(interlace.native, bool)
    assert blocks.BLOCKS is interlace.tracing.blocks.BLOCKS


class AsyncPlain:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def test_coroutine_callers_and_a_trace_inside_async_with():
    import asyncio

    async def f(cm):
        base = 2
        async with AsyncPlain():
            with cm():
                got = save([base * i for i in range(3)])
        await asyncio.sleep(0)
        return got

    assert asyncio.run(f(Tracer)) == asyncio.run(f(Inline)) == [0, 2, 4]
