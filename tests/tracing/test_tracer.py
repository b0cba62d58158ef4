"""The Tracer object: subclass steps, pickling, and the torch-free import."""

import ast
import os
import pickle
import subprocess
import sys

import pytest

from interlace import Backend, Tracer, save
from interlace.tracing import blocks

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


# -- subclasses override the small steps --------------------------------------------------------
class Doubling(Tracer):
    """`build` step: append `value = save(value * 2)` to every body."""

    def build(self, node):
        module = super().build(node)
        extra = ast.parse("value = save(value * 2)").body[0]
        ast.increment_lineno(extra, node.lineno - 1)  # report the with line
        module.body.append(extra)  # after the user's statements
        return module


def test_subclass_build_step_changes_what_runs():
    def f(cm):
        with cm():
            value = 21
        return value

    assert f(Doubling) == 42


def test_subclass_steps_get_their_own_cache_entries():
    def f(cm):
        with cm():
            value = save(1)
        return value, locals().get("doubled")

    assert f(Tracer) == (1, None)
    assert Doubling._capture_key is Doubling and Tracer._capture_key is None
    keys = [key for key, (code, _) in blocks.BLOCKS.items() if code is f.__code__]
    assert {key[2] for key in keys} == {None}


def test_subclass_overriding_enter_and_calling_super():
    class Logged(Tracer):
        entered = []

        def __enter__(self):
            Logged.entered.append(self)
            return super().__enter__()

    def f():
        with Logged() as tr:
            x = save(3)
        return tr, x

    tr, x = f()
    assert x == 3 and Logged.entered == [tr]
    assert tr.block.co_name == "f"


def test_subclass_execute_step():
    class Recording(Tracer):
        ran = []

        def execute(self, code):
            Recording.ran.append(code.co_name)
            super().execute(code)

    def f():
        with Recording() as tr:
            y = save(5)
        return tr, y

    tr, y = f()
    assert y == 5 and Recording.ran == ["f"]


def test_subclass_parse_step_can_decline():
    class Declining(Tracer):
        def parse(self, source, lineno):
            return None

    from interlace import WithBlockNotFoundError

    with pytest.raises(WithBlockNotFoundError, match="may have changed since it was first read"):
        with Declining():
            pass


def test_args_and_kwargs_are_kept():
    tracer = Tracer(1, "two", backend=None, key="value")
    assert tracer.args == (1, "two") and tracer.kwargs == {"key": "value"}
    assert type(tracer.backend) is Backend


# -- pickling -------------------------------------------------------------------------------
class KeepAlive(Backend):
    def __call__(self, tracer):
        super().__call__(tracer)


def captured():
    scale = 3
    with Tracer("payload", backend=KeepAlive()) as tracer:
        result = save([scale * i for i in range(3)])
    return tracer, result


def test_tracer_pickles_without_backend_ast_or_run_state():
    tracer, result = captured()
    assert result == [0, 3, 6]
    data = pickle.dumps(tracer)
    clone = pickle.loads(data)
    assert type(clone.backend) is Backend  # rebuilt default, not the pickled one
    assert clone.args == ("payload",)
    assert clone._frame is None and clone._state is None and clone._plan is None
    block = clone.block
    assert block.node is None and block.statements is None
    assert (block.filename, block.lineno, block.assigned_names) == (tracer.block.filename, tracer.block.lineno, frozenset({"result"}))


def test_unpickled_tracer_rebuilds_and_runs_its_body_elsewhere():
    tracer, _ = captured()
    clone = pickle.loads(pickle.dumps(tracer))
    values = clone.run_body({"scale": 10, "save": save, "range": range})
    assert values["result"] == [0, 10, 20]
    assert clone.block.statements is not None  # re-parsed from the pickled source slice


# -- import is torch-free -----------------------------------------------------------------------
@pytest.mark.slow  # starts a subprocess
def test_import_interlace_imports_neither_torch_nor_transformers():
    code = (
        "import sys, interlace, interlace.tracing\n"
        "from interlace import Tracer, Backend, save, WithBlockNotFoundError, UnsupportedBlockError\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(bad)\n"
    )
    env = dict(os.environ, PYTHONPATH=SRC)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_public_names():
    import interlace

    for name in ("Tracer", "Backend", "save", "WithBlockNotFoundError", "UnsupportedBlockError", "InterlaceError", "native"):
        assert name in interlace.__all__
    assert issubclass(interlace.WithBlockNotFoundError, interlace.InterlaceError)
    assert issubclass(interlace.UnsupportedBlockError, interlace.InterlaceError)


def test_a_skip_refusal_is_cached_per_site(monkeypatch):
    from interlace import UnsupportedBlockError
    from interlace.tracing import skip

    calls = []

    def refusing(frame, code, block, facts):
        calls.append(block)
        raise UnsupportedBlockError(f"{block.filename}:{block.lineno}: cannot skip this (test)")

    monkeypatch.setattr(skip, "_make_plan", refusing)  # the analysis behind skip.plan

    def f():
        with Tracer():
            x = 1

    for _ in range(3):
        with pytest.raises(UnsupportedBlockError, match="cannot skip this"):
            f()
    assert len(calls) == 1


def test_capture_without_a_frame_returns_the_entered_block():
    with Tracer() as tracer:
        y = 1
    assert tracer.capture() is tracer.block
    assert tracer.block.assigned_names == frozenset({"y"})


def test_unpickled_block_with_scope_declarations_recompiles():
    def outer():
        count = 1

        def inner():
            with Tracer() as tracer:
                nonlocal count
                count = save(count + 1)
            return tracer

        return inner(), count

    tracer, count = outer()
    assert count == 2
    clone = pickle.loads(pickle.dumps(tracer))
    assert clone.run_body({"count": 5, "save": save})["count"] == 6
