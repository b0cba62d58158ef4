"""Warm sites: the policy decides a `with` site once and registers the decision with the
frame mechanism (`frames.register_site`); the compiled `Tracer.__enter__`/`__exit__` then
serve the site by mechanism alone, reading the tracer's fields by offset (`TracerBase`), so
renaming a Python attribute cannot quietly send every entry back to the slow path.

The references here are independent of the code under test: what a registered record must
hold is read from the plan and Block the policy made, the warm path is observed through the
compiled module's own counter and a profile function, and field semantics are compared with
a plain Python class written out in the test.
"""

import gc
import pickle
import sys
import threading
import types
import weakref

import pytest

import interlace
from interlace import Backend, Tracer, save
from interlace._native import frames
from interlace.tracing import blocks
from interlace.tracing import tracer as tracer_module

ROUNDS = 20


class Counting(Backend):
    def __init__(self):
        self.calls = 0

    def __call__(self, tracer):
        self.calls += 1
        super().__call__(tracer)


def _with_lasti(function):
    """f_lasti of the with's enter instruction in `function` (seen from a spy tracer)."""
    seen = []

    class Spy(Tracer):
        def __enter__(self):
            seen.append(sys._getframe(1).f_lasti)
            return super().__enter__()

    function(Spy)
    return seen[0]


@pytest.mark.native_only
def test_the_compiled_warm_path_serves_every_entry_after_the_first():
    """On every version: after the policy registered a site, each entry is served in C
    (the counter the compiled module keeps), and the Python policy never runs."""
    policy = tracer_module._policy_enter.__code__
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is policy:
            calls.append(1)

    def f(n):
        out = []
        for i in range(n):
            with Tracer():
                v = save(i * 7)
            out.append(v)
        return out

    assert f(1) == [0]  # cold: captured, planned, registered
    before = frames.warm_entries()
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        assert f(ROUNDS) == [i * 7 for i in range(ROUNDS)]
    finally:
        sys.setprofile(previous)
    assert frames.warm_entries() - before == ROUNDS
    assert calls == []


def test_the_record_is_what_the_policy_decided():
    def f(T):
        with T() as tr:
            w = save(5)
        return w, tr

    w, tr = f(Tracer)
    assert w == 5
    code = f.__code__
    lasti = _with_lasti(f)
    record = frames.site(code, lasti, Tracer)
    assert record is not None
    block, plan, arm_args = record
    assert block is tr.block and block.lineno == code.co_firstlineno + 1
    assert arm_args == plan.arm_args
    assert frames.site(code, lasti + 2, Tracer) is None  # another instruction: no record


def test_each_tracer_type_has_its_own_record_and_the_same_block():
    class Sub(Tracer):
        pass

    def f(T):
        with T() as tr:
            w = save(6)
        return w, tr

    (_, a), (_, b) = f(Tracer), f(Sub)
    lasti = _with_lasti(f)
    assert frames.site(f.__code__, lasti, Tracer)[0] is a.block
    assert frames.site(f.__code__, lasti, Sub)[0] is b.block
    assert a.block is b.block  # Sub overrides no step: one capture serves both


def test_a_pass_only_body_is_registered_to_run_inline():
    backend = Counting()
    ran = []

    def f(T, n=1):
        for _ in range(n):
            with T(backend=backend):
                pass
            ran.append(1)

    lasti = _with_lasti(f)
    f(Tracer, ROUNDS)
    assert backend.calls == ROUNDS + 1 and len(ran) == ROUNDS + 1
    block, plan, arm_args = frames.site(f.__code__, lasti, Tracer)
    assert block.passonly and plan is None and arm_args is None
    assert frames.armed_count() == 0


def test_a_record_holds_neither_its_code_nor_its_block():
    """The record sits on the code object; the Block (whose body functions hold the globals
    that hold the code) is held weakly, so dropping the site from BLOCKS frees them all."""
    import linecache

    from interlace.tracing import sites

    filename = "<interlace-test-warm-record>"
    source = "def run(k):\n    with Tracer():\n        value = save([k])\n    return value\n"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        namespace = {"Tracer": Tracer, "save": save}
        exec(compile(source, filename, "exec"), namespace)
        assert [namespace["run"](k) for k in range(3)] == [[0], [1], [2]]
        code_ref = weakref.ref(namespace["run"].__code__)
        keys = [key for key, entry in blocks.BLOCKS.items() if entry[0] is code_ref()]
        block_refs = [weakref.ref(blocks.BLOCKS[key][1]) for key in keys]
        assert keys
        for key in keys:
            del blocks.BLOCKS[key]
        sites._DECODED.pop(id(code_ref()), None)  # the bytecode analysis's own (bounded) cache
        del namespace  # its only other holders: the body functions' globals, i.e. a cycle
        gc.collect()
        assert code_ref() is None
        assert all(ref() is None for ref in block_refs)
    finally:
        linecache.cache.pop(filename, None)


def test_a_site_whose_block_was_dropped_is_decided_again():
    backend = Counting()

    def f(T):
        with T(backend=backend) as tr:
            h = save(9)
        return h, tr

    lasti = _with_lasti(f)
    h, tr = f(Tracer)
    assert frames.site(f.__code__, lasti, Tracer)[0] is tr.block
    first = weakref.ref(tr.block)
    for key in [key for key, entry in blocks.BLOCKS.items() if entry[0] is f.__code__]:
        del blocks.BLOCKS[key]
    del tr
    gc.collect()
    assert first() is None
    assert frames.site(f.__code__, lasti, Tracer) is None
    h, tr = f(Tracer)  # captured again, registered again
    assert h == 9 and frames.site(f.__code__, lasti, Tracer)[0] is tr.block


def test_a_class_level_field_is_refused_where_the_class_is_written():
    with pytest.raises(TypeError, match=r"test_warm_sites\.py:\d+: .*Shadow defines _state at class level"):
        class Shadow(Tracer):
            _state = None

    with pytest.raises(TypeError, match="block, backend at class level"):
        class Both(Tracer):
            block = None
            backend = None


def test_the_base_fields_are_the_ones_the_tracer_names():
    """The compiled TracerBase exposes exactly the fields the Python side lists, so a rename
    on either side fails here rather than dropping the warm path."""
    assert set(tracer_module._FIELDS) <= set(dir(frames.TracerBase))
    if frames.COMPILED:
        getsets = {name for name, value in vars(frames.TracerBase).items()
                   if type(value) is types.GetSetDescriptorType}
        assert getsets == set(tracer_module._FIELDS)


class _Reference:
    """The field semantics written out in plain Python (what TracerBase must match)."""

    def __init__(self, *args, backend=None, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.backend = tracer_module._DEFAULT_BACKEND if backend is None else backend


@pytest.mark.parametrize(
    "args, kwargs",
    [((), {}), ((1, 2), {}), ((), {"backend": None}), ((3,), {"x": 1, "backend": None}), ((), {"y": [2]})],
)
def test_init_keeps_args_kwargs_and_the_default_backend(args, kwargs):
    got, want = Tracer(*args, **kwargs), _Reference(*args, **kwargs)
    assert got.args == want.args and got.kwargs == want.kwargs and got.backend is want.backend
    got.kwargs["added"] = 1  # the same dict on every read
    assert got.kwargs["added"] == 1
    mine = Counting()
    assert Tracer(*args, **{**kwargs, "backend": mine}).backend is mine
    caller_kwargs = dict(kwargs)
    Tracer(**caller_kwargs).kwargs["z"] = 0
    assert caller_kwargs == kwargs  # the caller's dict is not the tracer's


def test_fields_read_none_until_set_and_none_unsets():
    tr = Tracer()
    assert tr.block is None and tr._frame is None and tr._plan is None and tr._armed is None
    tr._state = "s"
    assert tr._state == "s"
    tr._state = None
    assert tr._state is None
    tr.extra = 1  # subclasses keep a __dict__
    assert tr.extra == 1 and "extra" in vars(tr)


@pytest.mark.native_only
def test_only_an_armed_handle_is_accepted_as_armed():
    with pytest.raises(TypeError, match="armed handle"):
        Tracer()._armed = object()


def test_a_tracer_entered_twice_is_refused_and_nothing_stays_armed():
    class Twice(Tracer):
        def __enter__(self):
            Tracer.__enter__(self)
            try:
                return Tracer.__enter__(self)  # armed already: refused, not armed twice
            except interlace.InterlaceError:
                frames.disarm(self._armed)
                self._armed = None
                raise

    def f():
        with Twice():
            x = 1  # noqa: F841

    for _ in range(2):  # cold (policy), then warm (the compiled path hands it to the policy)
        with pytest.raises(interlace.InterlaceError, match=r"test_warm_sites\.py:\d+: this tracer is already entered"):
            f()
        assert frames.armed_count() == 0


def test_pickled_tracers_keep_their_fields_on_every_protocol():
    def f():
        with Tracer(1, flag=True) as tr:
            y = save(1)
        return tr

    tr = f()
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(tr, protocol=protocol))
        assert back.args == (1,) and back.kwargs == {"flag": True}
        assert back.block.lineno == tr.block.lineno and back._frame is None
        assert isinstance(back.backend, Backend)


def test_armed_stacks_are_per_thread():
    errors, barrier = [], threading.Barrier(4)

    def f(k):
        with Tracer():
            v = save(k)
        return v

    def worker(k):
        try:
            barrier.wait()
            assert [f(k * 100 + i) for i in range(ROUNDS)] == [k * 100 + i for i in range(ROUNDS)]
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and frames.armed_count() == 0


def test_user_frame_walks_past_marked_enter_frames_only():
    here = sys._getframe()
    assert frames.user_frame(here) is here

    def inner():
        return frames.user_frame(sys._getframe())

    frames.look_past(inner.__code__)
    assert inner() is here


def test_a_tracer_that_goes_while_armed_disarms():
    """A subclass's __enter__ that raises after arming leaves no armed skip once the tracer
    goes (the with never calls __exit__ then)."""

    class Failing(Tracer):
        def __enter__(self):
            super().__enter__()
            raise KeyError("after arming")

    def f():
        with Failing():
            x = 1  # noqa: F841

    for _ in range(3):
        try:
            f()
        except KeyError as error:
            assert frames.armed_count() == 1  # its traceback holds __enter__'s frame, so the tracer
            del error
        else:  # pragma: no cover
            raise AssertionError("the error was swallowed")
        assert frames.armed_count() == 0
