"""The Tracer's warm path: on the native path a warm `with Tracer():` entry is looked up,
armed and disarmed in C (`_cframes.tracer_methods`); everything else goes to the Python
`__enter__`/`__exit__` (the policy). These tests drive each case warm (the same site many
times) and check it behaves exactly as the Python methods do: on the twin path the Python
methods are the only ones, so every test here runs on both paths.
"""

import copy
import os
import pickle
import sys
import threading
import traceback
import weakref

import pytest

import interlace
from interlace import Backend, Tracer, UnsupportedBlockError, WithBlockNotFoundError, save
from interlace._native import frames
from interlace.tracing import tracer as tracer_module

ROUNDS = 50


def _armed_count():
    return frames.armed_count()


def _stack_empty():
    return frames.armed_count() == 0


class Counting(Backend):
    def __init__(self):
        self.calls = 0

    def __call__(self, tracer):
        self.calls += 1
        super().__call__(tracer)


def test_the_native_path_has_c_methods_and_the_twin_the_python_ones():
    if frames.COMPILED:
        assert not hasattr(Tracer.__enter__, "__code__")
        assert not hasattr(Tracer.__exit__, "__code__")
    else:
        assert Tracer.__enter__ is tracer_module._policy_enter
        assert Tracer.__exit__ is tracer_module._policy_exit
    assert tracer_module._policy_enter.__name__ == "__enter__"
    assert tracer_module._policy_exit.__name__ == "__exit__"


def test_a_warm_site_runs_the_backend_each_time_and_leaves_nothing_armed():
    backend = Counting()

    def f(n):
        out = []
        for i in range(n):
            with Tracer(backend=backend) as tr:
                h = save([i, i * 2])
            out.append(h)
        return out, tr

    got, tr = f(ROUNDS)
    assert got == [[i, i * 2] for i in range(ROUNDS)]
    assert backend.calls == ROUNDS
    assert _stack_empty() and _armed_count() == 0
    assert tr.block is not None and tr.block.lineno == f.__code__.co_firstlineno + 3
    # per-run state is cleared by __exit__, as by the Python method
    assert tr._frame is None and tr._plan is None and tr._state is None and tr._parent is None


def test_warm_nested_traces_push_all_locals_to_the_enclosing_body():
    def f(n):
        out = []
        for i in range(n):
            with Tracer():
                with Tracer():
                    inner = i + 1
                outer = save(inner * 10)
            out.append(outer)
        return out

    assert f(ROUNDS) == [(i + 1) * 10 for i in range(ROUNDS)]
    assert _stack_empty()


def test_subclass_enter_calling_super_is_warm_too():
    seen = []

    class Sub(Tracer):
        def __enter__(self):
            seen.append("enter")
            return super().__enter__()

        def __exit__(self, *exc):
            seen.append("exit")
            return super().__exit__(*exc)

    def f(n):
        for i in range(n):
            with Sub() as sub:
                y = save(i * 3)
        return y, sub

    y, sub = f(ROUNDS)
    assert y == (ROUNDS - 1) * 3
    assert seen == ["enter", "exit"] * ROUNDS
    assert sub.block.lineno == f.__code__.co_firstlineno + 2
    assert _stack_empty()


def test_subclass_overriding_steps_gets_its_own_entry():
    built = []

    class Steps(Tracer):
        def build(self, node):
            built.append(node.lineno)
            return super().build(node)

    def f(cm, n):
        for i in range(n):
            with cm():
                z = save(i + 100)
        return z

    assert f(Tracer, ROUNDS) == ROUNDS + 99
    assert f(Steps, ROUNDS) == ROUNDS + 99
    assert built and set(built) == {f.__code__.co_firstlineno + 2}
    first = len(built)
    assert f(Steps, ROUNDS) == ROUNDS + 99
    assert len(built) == first  # compiled for its own capture key once, then warm


def test_pass_only_body_runs_inline_and_the_backend_still_runs_every_time():
    backend = Counting()
    ran = []

    def f(n):
        for _ in range(n):
            with Tracer(backend=backend):
                pass
            ran.append(1)

    f(ROUNDS)
    assert backend.calls == ROUNDS and len(ran) == ROUNDS
    assert _stack_empty()


def test_a_refusal_is_raised_every_time_ending_at_the_users_with_line():
    def f():
        with Tracer():
            return 1

    for _ in range(3):
        with pytest.raises(UnsupportedBlockError, match="test_fastpath.py") as info:
            f()
        names = [fr.name for fr in traceback.extract_tb(info.value.__traceback__)]
        # natively the C __enter__ leaves no frame; the twin's Python __enter__ raises it
        expected = ["f"] if interlace.native else ["f", "__enter__"]
        assert names[-len(expected):] == expected
    assert _stack_empty()


def test_not_a_with_block_is_reported_from_a_warm_function():
    def f(tracer):
        return tracer.__enter__()

    for _ in range(3):
        with pytest.raises(WithBlockNotFoundError, match="not used as a with block"):
            f(Tracer())


def _internal(tb):
    return [fr.name for fr in traceback.extract_tb(tb) if os.sep + "interlace" + os.sep in fr.filename]


# Natively no interlace frame is left; the twin keeps the one Python __exit__ that re-raises.
OURS = [] if interlace.native else ["__exit__"]


def test_warm_backend_errors_leave_no_interlace_frame_and_clear_the_run():
    class Failing(Backend):
        def __call__(self, tracer):
            assert tracer._frame is not None and tracer._plan is not None
            raise KeyError("from the backend")

    def f():
        with Tracer(backend=Failing()) as tr:
            x = 1  # noqa: F841
        return tr

    tracers = []
    for _ in range(5):
        with pytest.raises(KeyError, match="from the backend") as info:
            f()
        assert _internal(info.value.__traceback__) == OURS
        frame = info.value.__traceback__.tb_next.tb_frame  # f's with line (then the twin's __exit__)
        tracers.append(frame.f_locals.get("tr"))
    assert _stack_empty()


def test_warm_body_errors_keep_their_type_and_the_user_line():
    class Custom(Exception):
        pass

    def f(i):
        with Tracer():
            if i >= 0:
                raise Custom(f"boom {i}")

    for i in range(5):
        with pytest.raises(Custom, match=f"boom {i}") as info:
            f(i)
        frames_ = traceback.extract_tb(info.value.__traceback__)
        assert frames_[-1].name == "f" and "raise Custom" in frames_[-1].line
        assert _internal(info.value.__traceback__) == OURS
        assert info.value.__context__ is None
    assert _stack_empty()


def test_an_error_in_the_as_binding_is_the_users_and_disarms():
    class Target:
        fail = True

        def __setattr__(self, name, value):
            if Target.fail:
                raise AttributeError("cannot bind here")
            object.__setattr__(self, name, value)

    target = Target()

    def f(i):
        with Tracer() as target.tr:
            y = save(i)
        return y

    Target.fail = False
    assert [f(i) for i in range(5)] == list(range(5))
    Target.fail = True
    for _ in range(3):
        with pytest.raises(AttributeError, match="cannot bind here"):
            f(1)
        assert _stack_empty() and _armed_count() == 0
    Target.fail = False
    assert f(7) == 7


def test_exit_needs_three_arguments():
    tracer = Tracer()
    with pytest.raises(TypeError):
        tracer.__exit__(None, None)


def test_tracers_pickle_copy_and_weakref_after_warm_use():
    def f(n):
        for i in range(n):
            with Tracer() as tr:
                w = save(i)
        return tr, w

    tr, w = f(5)
    assert w == 4
    ref = weakref.ref(tr)
    assert ref() is tr
    tr.note = "kept"  # instances still have a __dict__
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(tr, protocol=protocol))
        assert type(back) is Tracer and back.note == "kept" and back._frame is None
        assert isinstance(back.backend, Backend)
    assert copy.copy(tr).note == "kept"


def test_threads_sharing_a_warm_site_stay_isolated():
    results = {}
    errors = []
    barrier = threading.Barrier(8)

    def f(k):
        with Tracer():
            v = save([k] * 3)
        return v

    def worker(k):
        try:
            barrier.wait()
            results[k] = [f(k * 100 + i) for i in range(ROUNDS)]
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(8):
        assert results[k] == [[k * 100 + i] * 3 for i in range(ROUNDS)]


def test_a_user_trace_function_sees_the_lines_after_a_warm_block():
    def f(n):
        total = 0
        for i in range(n):
            with Tracer():
                total = save(total + i)
            after = total  # noqa: F841
        return total

    f(3)  # warm
    lines = []

    def tracer(frame, event, arg):
        if frame.f_code is f.__code__:
            if event == "line":
                lines.append(frame.f_lineno - f.__code__.co_firstlineno)
            return tracer
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        assert f(3) == 3
    finally:
        sys.settrace(previous)
    assert 5 in lines  # `after = total` ran in every round
    assert lines.count(5) == 3


def test_warm_entries_do_not_call_the_python_enter_on_the_native_path():
    enter_code = tracer_module._policy_enter.__code__
    exit_code = tracer_module._policy_exit.__code__
    calls = {enter_code: 0, exit_code: 0}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in calls:
            calls[frame.f_code] += 1

    def f(n):
        for i in range(n):
            with Tracer():
                q = save(i)
        return q

    f(3)  # warm: captured, planned, this thread's stack exists
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        assert f(10) == 9
    finally:
        sys.setprofile(previous)
    # natively a clean warm entry runs no Python frame of ours (only the backend's)
    assert calls[exit_code] == calls[enter_code] == (0 if frames.COMPILED else 10)


def test_warm_backend_error_keeps_its_context_inside_a_users_except_block():
    class Inner(Exception):
        pass

    class Outer(Exception):
        pass

    class Failing(Backend):
        def __call__(self, tracer):
            try:
                raise Inner("handled in the backend")
            except Inner:
                if tracer.kwargs.get("bare"):
                    raise KeyError("while handling") from None
                raise KeyError("while handling")  # noqa: B904 - its context is the point

    def f(**kwargs):
        try:
            raise Outer("the user's")
        except Outer:
            with Tracer(backend=Failing(), **kwargs):
                v = 1  # noqa: F841

    for _ in range(3):
        with pytest.raises(KeyError) as info:
            f()
        assert type(info.value.__context__) is Inner and not info.value.__suppress_context__
        assert type(info.value.__context__.__context__) is Outer
        assert _internal(info.value.__traceback__) == OURS
        with pytest.raises(KeyError) as info:
            f(bare=True)
        assert info.value.__suppress_context__ and type(info.value.__context__) is Inner
    assert sys.exc_info() == (None, None, None)
    assert _stack_empty()


def test_a_warm_backend_error_is_freed_without_the_cycle_collector():
    import gc

    class Freed(Exception):  # (built-in exceptions take no weak references)
        pass

    class Failing(Backend):
        def __call__(self, tracer):
            raise Freed("freed")

    def f():
        with Tracer(backend=Failing()):
            x = 1  # noqa: F841

    refs = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            try:
                f()
            except Freed as error:
                refs.append(weakref.ref(error))
        assert [r() for r in refs] == [None, None, None]  # no cycle through our frames
    finally:
        if enabled:
            gc.enable()
