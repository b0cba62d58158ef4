"""A trace's per-trace steps: `Tracer.defer()`, `DeferredBody.run()`, `Tracer.push_result()`,
the save state (`TraceState`, `enter_body`/`exit_body`) and `.save()` on an object.

Natively the warm case of each is C with no Python frame (`frames.deferred_methods`,
`frames.save_hooks`, `frames.object_save`), and the Python methods are the policy for the
rest; on the twin the Python methods are all there is. Every test compares with the same
statements run inline (the `inline` fixture) or with plain Python, on both paths; the frame
count says where each path's work runs.
"""

import copy
import gc
import importlib
import pickle
import sys
import types
import weakref

import pytest

from interlace import Backend, InterlaceError, Tracer
from interlace._native import frames
from interlace.tracing import DeferredBody
from interlace.tracing.save import TraceState
from interlace.tracing.tracer import is_interlace_file

save_module = importlib.import_module("interlace.tracing.save")  # (the package's `save` is the function)


class DeferRunPush(Backend):
    """What an interleaving backend does with a body: defer, run, push."""

    def __call__(self, tracer):
        body = tracer.defer()
        tracer.push_result(body.run())


BACKEND = DeferRunPush()


class Deferred(Tracer):
    def __init__(self, *args):
        super().__init__(*args, backend=BACKEND)


def _interlace_calls(fn, *args):
    """fn(*args), and the Python frames of interlace's own files it ran."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and is_interlace_file(frame.f_code.co_filename):
            calls.append(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(previous)
    return result, calls


def _saves(kind, n):
    out = None
    for i in range(n):
        with kind(i):
            out = [i].save()
    return out


def test_a_warm_deferred_trace_runs_no_python_frame_of_the_core_natively(inline):
    _saves(Deferred, 3)  # warm: captured, planned, the body function compiled
    result, calls = _interlace_calls(_saves, Deferred, 10)
    assert result == _saves(inline, 10) == [9]
    if frames.COMPILED:
        # defer, run (enter/exit body, the call), push_result and `.save()`: all C
        assert calls == []
    else:
        assert {"defer", "run", "push_result", "__get__"} <= set(calls)


def _scenarios(kind):
    """Each shape the C warm paths distinguish, returning what the caller sees after."""
    out = {}

    def all_bound():
        a, b = [1], 2
        with kind():
            c = (a + [b]).save()
        return c, a, b

    def some_unbound(first):
        if first:
            late = 5
        with kind():
            seen = ("late" in dir()) and late  # a local of the caller unbound on one call
            kept = [seen].save()
        return kept

    def nested():
        with kind():
            outer = [0].save()
            with kind():
                inner = outer + [1]  # nested: every assigned name reaches the enclosing body
            both = (outer + inner).save()
        return both

    def raises():
        with kind():
            x = [1].save()
            raise KeyError("from the body")
        return x

    for _ in range(3):  # cold, then warm twice
        out.setdefault("all_bound", []).append(all_bound())
        out.setdefault("some_unbound", []).append((some_unbound(True), some_unbound(False)))
        out.setdefault("nested", []).append(nested())
        with pytest.raises(KeyError, match="from the body"):
            raises()
        out.setdefault("after_error", []).append((save_module.current(), len(save_module._Mount.running)))
    return out


def test_warm_deferred_runs_give_what_inline_gives(inline):
    running = len(save_module._Mount.running)
    assert _scenarios(Deferred) == _scenarios(inline)
    assert save_module.current() is None and len(save_module._Mount.running) == running


def test_a_subclass_overriding_push_result_and_defer_keeps_working():
    seen = []

    class Recording(Tracer):
        def defer(self, namespace=None, *, state=None):
            body = super().defer(namespace, state=state)
            seen.append(("defer", sorted(body.namespace)))
            return body

        def push_result(self, values):
            seen.append(("push", sorted(values)))
            super().push_result(values)

    class Backend_(Backend):
        def __call__(self, tracer):
            tracer.push_result(tracer.defer().run())

    def f(n):
        base = 10
        for i in range(n):
            with Recording(backend=Backend_()):
                total = [base + i].save()
        return total

    assert f(3) == [12]
    pushed = ("push", ["base", "i", "total"])
    assert seen == [("defer", ["base", "i"]), pushed] + [("defer", ["base", "i", "total"]), pushed] * 2


def test_dot_save_binds_to_instances_only_as_the_python_descriptor_does(inline):
    with Deferred():
        value = [7]
        bound = value.save
        checks = (bound() is value, None.save() is None, bound.__self__ is value).save()
    assert checks == (True, True, True)
    assert int.save is save_module._object_save  # a class sees the plain function
    with pytest.raises(AttributeError):
        types.ModuleType("m").save  # noqa: B018 - a module has none
    with pytest.raises(ValueError, match=r"\.save\(\) was called on a list outside a trace"):
        [1].save()
    assert repr(save_module.OBJECT_SAVE_DESCRIPTOR) == "<interlace .save() on every object>"
    with inline():
        assert save_module.current().saved == {} and [3].save() == [3]


def test_trace_state_is_a_save_set_shared_with_its_nested_states():
    top = TraceState(None)
    nested = TraceState(top)
    assert (top.saved, top.depth, top.parent) == ({}, 0, None)
    assert nested.saved is top.saved and nested.depth == 1 and nested.parent is top
    with pytest.raises(TypeError):
        TraceState(object())
    nested.depth = 0  # writable, as before
    assert nested.depth == 0
    top.saved[1] = "kept"
    again = pickle.loads(pickle.dumps(nested))
    assert (again.saved, again.depth, again.parent.saved) == ({1: "kept"}, 0, {1: "kept"})
    twin = copy.copy(top)
    assert twin.saved is top.saved and twin.parent is None and twin.depth == 0


def test_a_deferred_body_copies_field_by_field():
    class Keep(Backend):
        def __call__(self, tracer):
            tracer.kept = tracer.defer()

    def f():
        x = [1]
        with Tracer(backend=Keep()) as tracer:
            y = x.save()  # noqa: F841 - run by the test
        return tracer.kept

    body = f()
    twin = copy.copy(body)
    assert type(twin) is DeferredBody
    names = ("tracer", "block", "namespace", "globals", "state", "_params", "_code", "_entry")
    assert all(getattr(twin, name) is getattr(body, name) for name in names)
    assert twin.run() == body.run() == {"x": [1], "y": [1]}


def test_defer_outside_the_warm_case_is_the_policys():
    class Keep(Backend):
        def __call__(self, tracer):
            tracer.kept = (tracer.defer({"x": 1}, state=TraceState(None)), tracer.defer())

    def f():
        x = 2
        with Tracer(backend=Keep()) as tracer:
            y = [x].save()  # noqa: F841 - run later, by the test
        return tracer

    for _ in range(3):
        tracer = f()
    given, plain = tracer.kept
    assert isinstance(given, DeferredBody) and isinstance(plain, DeferredBody)
    assert given.run() == {"x": 1, "y": [1]} and plain.run() == {"x": 2, "y": [2]}
    assert given.state is not plain.state and plain.state is not None
    with pytest.raises(InterlaceError, match="defer\\(\\) needs a tracer whose with block was entered"):
        Tracer().defer()
    assert tracer.defer({"x": 5}).run() == {"x": 5, "y": [5]}  # after the block: a namespace is needed
    with pytest.raises(InterlaceError, match="pass `namespace=`"):
        tracer.defer()


def test_a_deferred_body_in_a_reference_cycle_is_collected():
    class Holder:
        pass

    kept = []

    class Keep(Backend):
        def __call__(self, tracer):
            kept.append(tracer.defer())

    def f():
        holder = Holder()
        with Tracer(backend=Keep()):
            holder.ok = True
        return holder

    for _ in range(3):
        holder = f()
    body = kept.pop()
    holder.body = body  # holder -> body -> namespace -> holder
    ref = weakref.ref(holder)
    kept.clear()
    del holder, body
    gc.collect()
    assert ref() is None


def test_a_warm_run_follows_the_blocks_last_function_as_it_changes():
    kept = []

    class Keep(Backend):
        def __call__(self, tracer):
            body = tracer.defer()
            kept.append(body)
            tracer.push_result(body.run())

    def f(n):
        with Tracer(backend=Keep()):
            out = [n * 2].save()
        return out

    assert [f(n) for n in range(3)] == [[0], [2], [4]]
    block = kept[-1].block
    function = block.last_function[2]
    block.last_function = None  # forgotten: the policy finds (or compiles) it again
    assert f(5) == [10] and block.last_function[2] is function
    block.last_function = (block.last_function[0], {}, function)  # other globals: not this one
    assert f(6) == [12] and block.last_function[1] is kept[-1].globals


def test_a_warm_generator_start_follows_the_blocks_last_generator():
    """`body.generator()` of a site whose previous start left its generator function on the
    Block (`last_generator`) makes the generator with no Python frame natively; forgotten, or
    kept for other globals, the Python method finds it again. Every start runs the body as
    written."""
    kept = []

    class Keep(Backend):
        def __call__(self, tracer):
            kept.append(tracer.defer())

    def f(n):
        with Tracer(backend=Keep()):
            out = [n * 2]  # noqa: F841 - read from the generator's final locals
        return kept[-1]

    def final_locals(body):
        gen = body.generator()
        with pytest.raises(StopIteration) as end:
            gen.send(None)  # (no read: it runs to its end)
        return DeferredBody.generator_locals(end.value.value)

    assert [final_locals(f(n))["out"] for n in range(3)] == [[0], [2], [4]]
    body = f(7)
    gen, calls = _interlace_calls(body.generator)
    assert calls == ([] if frames.COMPILED else ["generator", "generator_start"])
    with pytest.raises(StopIteration) as end:
        gen.send(None)
    assert DeferredBody.generator_locals(end.value.value) == {"n": 7, "out": [14]}
    block = body.block
    params, _, function = block.last_generator
    block.last_generator = None  # forgotten: the policy finds it again
    assert final_locals(f(5))["out"] == [10] and block.last_generator[2] is function
    block.last_generator = (params, {}, function)  # other globals: not this one
    body = f(6)
    assert final_locals(body)["out"] == [12] and block.last_generator[1] is body.globals
