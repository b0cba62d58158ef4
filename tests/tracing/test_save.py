"""save(): by identity, only inside a trace, on every object, and owned by the trace."""

import importlib
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


def test_save_outside_a_trace_raises_value_error():
    with pytest.raises(ValueError, match=r"save\(\) was called outside a trace"):
        save(1)


def test_method_save_outside_a_trace_raises_value_error():
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


def test_object_save_is_mounted_once():
    assert save_module.OBJECT_SAVE
    assert object.__dict__["save"] is save_module.OBJECT_SAVE_DESCRIPTOR
    assert save_module._mount_on_object() is True
    assert object.__dict__["save"] is save_module.OBJECT_SAVE_DESCRIPTOR
    assert [1].save.__func__ is save_module._object_save


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


def test_imports_that_walk_dir_do_not_see_save(tmp_path, monkeypatch):
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


def test_modules_and_classes_have_no_save_attribute():
    import types

    assert getattr(types.ModuleType("scratch"), "save", None) is None
    assert getattr(int, "save", None) is None and not hasattr(Tensorish, "save")
    assert hasattr(Tensorish(1), "save")


def test_torch_imported_after_interlace_keeps_torch_save():
    """In a subprocess: tests/tracing never imports torch itself."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed on this interpreter")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    code = (
        "import interlace, torch\n"
        "from interlace import Tracer\n"
        "assert torch.save.__module__ == 'torch.serialization', torch.save\n"
        "t = torch.ones(2)\n"
        "with Tracer():\n"
        "    kept = (t * 3).save()\n"
        "print(kept.tolist())\n"
    )
    env = dict(os.environ, PYTHONPATH=src)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[3.0, 3.0]"
