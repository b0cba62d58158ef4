"""save(): by identity, only inside a trace, on every object, and owned by the trace."""

import importlib
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from interlace import Backend, Tracer, save

# The module, not the function `interlace.tracing.save` that the package re-exports.
save_module = importlib.import_module("interlace.tracing.save")


class Tensorish:
    def __init__(self, value):
        self.value = value

    def __add__(self, other):
        return Tensorish(self.value + other)


def test_save_returns_the_object_itself():
    original = Tensorish(1)
    with Tracer():
        same = save(original)
        also = original.save()
        identical = save((same is original, also is original))
    assert same is original and also is original
    assert identical == (True, True)


def test_value_built_from_a_saved_one_is_not_saved():
    def f():
        with Tracer():
            h = save(Tensorish(1))
            derived = h + 1
        return h, "derived" in locals()

    h, has_derived = f()
    assert h.value == 1
    assert not has_derived


def test_saved_by_identity_under_any_name():
    def f():
        with Tracer():
            first = save([1])
            alias = first
            other = [1]  # equal, not identical: not saved
        return first, alias, "other" in locals()

    first, alias, has_other = f()
    assert first is alias and not has_other


@pytest.fixture
def only_our_save():
    """For tests of interlace's own `.save`: hide a foreign `save` that an earlier test left
    mounted in this process (importing nnsight mounts its own) while they run."""
    assert save_module.mount() is True
    with save_module._LOCK:
        displaced, save_module._Mount.displaced = save_module._Mount.displaced, None
    try:
        yield
    finally:
        with save_module._LOCK:
            save_module._Mount.displaced = displaced


def test_save_outside_a_trace_raises_value_error():
    with pytest.raises(ValueError, match=r"save\(\) was called outside a trace"):
        save(1)


def test_method_save_outside_a_trace_raises_value_error(only_our_save):
    with pytest.raises(ValueError, match=r"\.save\(\) was called on a list outside a trace"):
        [1, 2].save()
    with pytest.raises(ValueError, match=r"on a Tensorish outside a trace"):
        Tensorish(1).save()


@pytest.mark.parametrize("value", [1, 2.5, "text", (1, 2), [3], {"k": 4}, {5}, None, b"b", Tensorish(6), object()])
def test_save_method_on_any_value(value):
    def f(v):
        with Tracer():
            got = v.save()
        return got

    assert f(value) is value


def test_a_class_own_save_method_wins():
    class Image:
        def save(self, path):
            return f"wrote {path}"

    def f():
        with Tracer():
            img = Image()
            result = save(img.save("out.png"))
        return result

    assert f() == "wrote out.png"
    assert Image().save("x") == "wrote x"  # and outside a trace too


# -- the state belongs to the trace ---------------------------------------------------------
class ThreadBackend(Backend):
    """Runs the body in a worker thread (a fresh context: no ContextVar inherited)."""

    def __call__(self, tracer):
        box = {}

        def work():
            try:
                box["values"] = tracer.run_body()
            except BaseException as error:  # noqa: BLE001
                box["error"] = error

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        if "error" in box:
            raise box["error"]
        tracer.push_result(box["values"])


def test_saves_made_in_another_thread_count_for_the_trace():
    def f():
        with Tracer(backend=ThreadBackend()):
            h = save([threading.get_ident()])
            unsaved = 1
        return h, "unsaved" in locals()

    h, has_unsaved = f()
    assert h[0] != threading.get_ident()
    assert not has_unsaved


def test_saves_made_in_a_greenlet_count_for_the_trace():
    greenlet = pytest.importorskip("greenlet")

    class GreenletBackend(Backend):
        def __call__(self, tracer):
            worker = greenlet.greenlet(tracer.run_body)
            values = worker.switch()
            tracer.push_result(values)

    def f():
        with Tracer(backend=GreenletBackend()):
            h = save(["greenlet"])
            nested_depth = save(save_module.current().depth)
        return h, nested_depth

    assert f() == (["greenlet"], 0)


def test_nested_traces_track_depth_and_share_saves():
    depths = []

    def f():
        with Tracer():
            depths.append(save_module.current().depth)
            with Tracer():
                depths.append(save_module.current().depth)
                inner = save("x")
        return inner

    assert f() == "x"
    assert depths == [0, 1]
    assert save_module.current() is None


def test_traces_from_eight_threads_stay_isolated():
    barrier = threading.Barrier(8)
    results = {}
    errors = []

    def worker(index):
        try:
            for round_ in range(20):
                with Tracer():
                    barrier.wait() if round_ == 0 else None
                    mine = save((index, round_))
                    not_mine = (index + 1, round_)
                results.setdefault(index, []).append((mine, "not_mine" in locals()))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for index in range(8):
        assert results[index] == [((index, r), False) for r in range(20)]


def test_concurrent_traces_do_not_see_each_others_saves():
    """Two traces overlap in time (one waits inside its body): saves stay apart."""
    inside = threading.Event()
    release = threading.Event()
    out = {}

    def slow():
        with Tracer():
            secret = save([1])
            inside.set()
            release.wait(5)
            visible = save(len(save_module.current().saved))
        out["slow"] = visible

    thread = threading.Thread(target=slow)
    thread.start()
    inside.wait(5)
    with Tracer():
        a = save(1)
        b = save(2)
        c = save(3)
    release.set()
    thread.join()
    assert (a, b, c) == (1, 2, 3)
    assert out["slow"] == 1  # only its own save (itself), none of the main thread's three


# -- the `.save` mount on `object` ------------------------------------------------------------
# What is on `object` is process-wide, so the cases that depend on the order of events run in
# fresh interpreters (same interlace path: the INTERLACE_* switches are inherited).
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def run_fresh(code, *paths):
    """Run `code` in a fresh interpreter that imports interlace from src/ (and `paths`); its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, *map(str, paths)]))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow  # starts a subprocess
def test_import_mounts_nothing_and_the_first_trace_body_mounts():
    out = run_fresh("""
        import interlace
        from interlace import Tracer
        before = "save" in object.__dict__, hasattr([], "save")
        with Tracer():
            kept = [1].save()
        from interlace.tracing.save import OBJECT_SAVE_DESCRIPTOR
        print(before, kept, object.__dict__["save"] is OBJECT_SAVE_DESCRIPTOR)
    """)
    assert out == "(False, False) [1] True"


def test_mounted_once_and_it_stays():
    with Tracer():
        pass_through = [0].save()
    assert pass_through == [0]
    assert object.__dict__["save"] is save_module.OBJECT_SAVE_DESCRIPTOR
    assert save_module.mount() is True
    assert object.__dict__["save"] is save_module.OBJECT_SAVE_DESCRIPTOR
    value = [1]
    bound = value.save  # (natively a C bound method, on the twin `_object_save` bound)
    assert bound.__self__ is value and bound.__name__ == "save"


EXPERIMENT = """
from interlace import Tracer

with Tracer():
    kept = [1, 2].save()
    class_has_save = save(hasattr(int, "save"))  # no: pybind11 may be defining a `save` now
OFF_AFTER_THE_BODY = "save" not in object.__dict__  # the import goes on without it
"""


@pytest.mark.slow  # starts a subprocess
def test_a_trace_at_import_time_can_save(tmp_path):
    """The issue's case: a module that runs a trace when imported, after interlace was."""
    (tmp_path / "experiment_at_import.py").write_text("from interlace import save\n" + EXPERIMENT)
    out = run_fresh("""
        import interlace
        import experiment_at_import as e
        print(e.kept, "save" in object.__dict__)
    """, tmp_path)
    assert out == "[1, 2] True"
    # Mounted already when the import starts (the import guard is on): a class has no `save`
    # during the body, and the rest of the import runs without it.
    out = run_fresh("""
        import interlace
        with interlace.Tracer():
            first = [0].save()
        import experiment_at_import as e
        print(e.kept, e.class_has_save, e.OFF_AFTER_THE_BODY, "save" in object.__dict__)
    """, tmp_path)
    assert out == "[1, 2] False True True"


@pytest.mark.slow  # starts a subprocess
def test_save_stays_on_while_another_thread_imports(tmp_path):
    """A body running in one thread keeps `.save()` while another thread imports a module."""
    (tmp_path / "slow_import.py").write_text(
        "import slow_import_events as ev\n"
        "ev.importing.set()\n"
        "assert ev.saved.wait(10)\n"
        "DURING_BODY = 'save' in object.__dict__\n"
        "ev.checked.set()\n"
        "assert ev.body_done.wait(10)\n"
        "AFTER_BODY = 'save' in object.__dict__\n"
    )
    out = run_fresh("""
        import sys, threading, types
        import interlace
        ev = sys.modules["slow_import_events"] = types.ModuleType("slow_import_events")
        ev.importing, ev.saved, ev.checked, ev.body_done = (threading.Event() for _ in range(4))
        got = {}
        with interlace.Tracer():
            first = [0].save()  # mounted (and the import guard on) before the import starts

        def trace():
            with interlace.Tracer():
                ev.importing.wait(10)
                kept = [7].save()   # while the main thread is inside `import slow_import`
                ev.saved.set()
                ev.checked.wait(10)
            got["kept"] = kept
            ev.body_done.set()

        thread = threading.Thread(target=trace)
        thread.start()
        import slow_import
        thread.join()
        print(got, slow_import.DURING_BODY, slow_import.AFTER_BODY, "save" in object.__dict__)
    """, tmp_path)
    assert out == "{'kept': [7]} True False True"


def test_classes_read_save_as_a_function_and_modules_have_none(only_our_save):
    """`torch.compile` reads every name of `dir(torch.Tensor)`; pybind11 probes modules."""
    import types

    with Tracer():
        pass_through = save(1)
    assert pass_through == 1
    assert int.save is save_module._object_save and Tensorish.save is save_module._object_save
    walked = {name: getattr(Tensorish, name) for name in dir(Tensorish)}  # what dynamo does
    assert walked["save"] is save_module._object_save
    assert getattr(types.ModuleType("scratch"), "save", None) is None
    assert "save" not in dir(types.ModuleType("scratch"))


# -- `save` on every object must not break imports that walk dir() -------------------------------
STRICT_MODULE = '''
class Strict:
    """Like anyio's TypedAttributeSet: every public attribute in dir() needs an annotation."""

    def __init_subclass__(cls):
        annotations = getattr(cls, "__annotations__", {})
        for name in dir(cls):
            if not name.startswith("_") and name not in annotations:
                raise TypeError(f"attribute {name!r} is missing its type annotation")


class Checked(Strict):
    size: int = 1


class Copier:
    """Like torch's __init__: copy every attribute of dir(instance) somewhere."""

    def run(self):
        return sorted(name for name in dir(self) if not name.startswith("_"))


COPIED = Copier().run()
'''


def test_imports_that_walk_dir_do_not_see_save(tmp_path, monkeypatch, only_our_save):
    (tmp_path / "strict_dir_walker.py").write_text(STRICT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("strict_dir_walker")
    assert module.COPIED == ["run"]
    assert module.Checked.size == 1
    # ...and `.save()` is back once the import is done.
    assert "save" in dir(module.Copier())
    with Tracer():
        kept = [1].save()
    assert kept == [1]


@pytest.mark.slow  # starts a subprocess
def test_torch_transformers_anyio_import_after_interlace_and_after_a_trace():
    """In a subprocess: tests/tracing never imports torch itself."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed on this interpreter")
    optional = [name for name in ("transformers", "anyio") if importlib.util.find_spec(name) is not None]
    out = run_fresh(f"""
        import interlace
        from interlace import Tracer
        with Tracer():
            first = [0].save()          # mounted before torch is imported
        import torch
        for name in {optional!r}:
            __import__(name)
        assert torch.save.__module__ == "torch.serialization", torch.save
        t = torch.ones(2)
        with Tracer():
            kept = (t * 3).save()
        print(kept.tolist())
    """)
    assert out == "[3.0, 3.0]"


# -- chaining to another library's `save` (nnsight 0.8.1 mounts one the same way) ----------------
FAKE_MOUNTER = '''
"""Mounts `save` on object as nnsight 0.8.1 does: an instancemethod written into object's
dict, no chaining, raising outside its own traces. CHAIN=True: a polite one that defers to
whatever it displaced outside its traces."""
import contextlib, ctypes, gc

CHAIN = False
depth = 0
saved = []
found = None


def save(value, _=None):
    if depth == 0:
        if CHAIN and found is not None:
            return found.__get__(value, type(value))()
        raise ValueError("fake_mounter: save() outside a fake trace")
    saved.append(value)
    return value


@contextlib.contextmanager
def trace():
    global depth
    depth += 1
    try:
        yield
    finally:
        depth -= 1


def mount():
    global found
    found = object.__dict__.get("save")
    new = ctypes.pythonapi.PyInstanceMethod_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.py_object]
    (namespace,) = [r for r in gc.get_referents(object.__dict__) if type(r) is dict]
    namespace["save"] = new(save)
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(object))
'''

COEXIST_CHECK = """
from interlace import Tracer, save

def check():
    with fake_mounter.trace():
        theirs = [1].save()
        none = None.save()
    assert fake_mounter.saved[-2:] == [[1], None] and fake_mounter.saved[-2] is theirs
    with Tracer():
        ours = [2].save()
        by_function = save([3])
        no_value = None.save()
    assert (ours, by_function, no_value) == ([2], [3], None)
    try:
        [4].save()
    except ValueError as error:
        assert "fake_mounter" in str(error), error   # deferred to theirs outside our traces
    else:
        raise AssertionError("no error outside any trace")
    try:
        save(5)
    except ValueError as error:
        assert "outside a trace" in str(error), error
    assert int.save is fake_mounter.save   # a class sees theirs, as if we were not there

check()
check()
print("ok")
"""

ORDERS = {
    "interlace first": "import interlace\nimport fake_mounter\nfake_mounter.mount()\n",
    "theirs first": "import fake_mounter\nfake_mounter.mount()\nimport interlace\n",
    "interlace traced first": (
        "import interlace\nwith interlace.Tracer():\n    x = [0].save()\n"
        "import fake_mounter\nfake_mounter.mount()\n"
    ),
    "mounted during an import": (  # nnsight mounts at the end of its own import
        "import interlace\nwith interlace.Tracer():\n    x = [0].save()\n"
        "import fake_mounter_at_import\nimport fake_mounter\n"
    ),
}


@pytest.mark.slow  # starts a subprocess
@pytest.mark.parametrize("order", list(ORDERS))
def test_each_library_saves_in_its_own_traces(order, tmp_path):
    (tmp_path / "fake_mounter.py").write_text(FAKE_MOUNTER)
    (tmp_path / "fake_mounter_at_import.py").write_text("import fake_mounter\nfake_mounter.mount()\n")
    assert run_fresh(ORDERS[order] + COEXIST_CHECK, tmp_path) == "ok"


@pytest.mark.slow  # starts a subprocess
def test_a_mounter_that_chains_back_to_ours_does_not_loop(tmp_path):
    (tmp_path / "fake_mounter.py").write_text(FAKE_MOUNTER)
    out = run_fresh("""
        import interlace
        with interlace.Tracer():
            x = [0].save()
        import fake_mounter
        fake_mounter.CHAIN = True
        fake_mounter.mount()           # over ours, deferring to ours outside its traces
        with interlace.Tracer():       # ours goes on top again, deferring to theirs
            ours = [1].save()
        with fake_mounter.trace():
            theirs = [2].save()
        try:
            [3].save()
        except ValueError as error:
            print(ours, theirs, "outside a trace" in str(error))
    """, tmp_path)
    assert out == "[1] [2] True"


# -- `save` the function: natively one C call, the Python function's behaviour in every case --
def test_save_by_keyword_and_bad_calls_behave_as_the_python_function():
    with Tracer():
        kept = save(value=[7])
        try:
            save()
        except TypeError as error:
            missing = save(str(error))
        try:
            save(1, 2)
        except TypeError as error:
            extra = save(str(error))
        try:
            save(other=1)
        except TypeError as error:
            unknown = save(str(error))
    assert kept == [7]
    assert "missing 1 required positional argument: 'value'" in missing
    assert "takes 1 positional argument but 2 were given" in extra
    assert "unexpected keyword argument 'other'" in unknown
    with pytest.raises(ValueError, match=r"save\(\) was called outside a trace"):
        save(value=1)


def test_save_keeps_the_python_function_signature_name_doc_and_pickles():
    import inspect
    import pickle

    assert str(inspect.signature(save)) == "(value)"
    assert save.__name__ == "save"
    assert save.__module__ == "interlace.tracing.save"
    assert save.__doc__.startswith("Mark `value` (by identity) to be pushed back after the trace")
    assert pickle.loads(pickle.dumps(save)) is save
    assert save_module.save is save


@pytest.mark.native_only
def test_save_in_a_trace_runs_no_python_frame_natively():
    import types

    assert isinstance(save, types.BuiltinFunctionType)
    frames = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == save_module.__file__:
            frames.append(frame.f_code.co_name)

    value = [1]
    sys.setprofile(profile)
    try:
        with Tracer():
            same = save(value)
    finally:
        sys.setprofile(None)
    assert same is value
    assert "save" not in frames
