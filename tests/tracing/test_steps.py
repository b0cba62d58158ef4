"""The Tracer's steps in their specified shapes, and every route running what they make.

    parse(source: str, lineno: int) -> ast.With | ast.AsyncWith | None
    build(node) -> ast.Module              (the block's body statements)
    compile(module, frame) -> CodeType     (exec(code, globals, locals) runs it)
    execute(code) -> None                  (runs the body, pushes with push_result)

References: the statements themselves (`ast.unparse` of the source's body), plain `exec`,
and the block run inline (`Inline`, conftest).
"""

import ast
import sys
import textwrap
import traceback
import types
import warnings

import pytest

from interlace import Backend, Tracer, WithBlockNotFoundError, save
from interlace.tracing import blocks

from .conftest import Inline


@pytest.fixture
def tracer():
    return Tracer()


def body(node):
    return "\n".join(ast.unparse(statement) for statement in node.body)


# -- parse ----------------------------------------------------------------------------------
class TestParse:
    def test_single_block(self, tracer):
        node = tracer.parse("with A():\n    x = 1\n    y = 2\n", 1)
        assert isinstance(node, ast.With) and body(node) == "x = 1\ny = 2"

    def test_blocks_selected_by_line(self, tracer):
        source = "with A():\n    a = 1\nwith B():\n    b = 2\n"
        assert body(tracer.parse(source, 1)) == "a = 1"
        assert body(tracer.parse(source, 3)) == "b = 2"

    def test_line_numbers_are_the_files(self, tracer):
        source = "x = 0\n\n\ndef f():\n    a = 1\n    with A():\n        y = 1\n        z = 2\n    a = 3\n"
        node = tracer.parse(source, 6)
        assert node.lineno == 6 and [s.lineno for s in node.body] == [7, 8]
        assert body(node) == "y = 1\nz = 2"  # the code after the block is not in it

    def test_multiline_header(self, tracer):
        source = "def f():\n    with A(\n        1,\n        2,\n    ) as t:\n        z = 9\n    after = 2\n"
        node = tracer.parse(source, 2)
        assert node.lineno == 2 and body(node) == "z = 9" and node.body[0].lineno == 6

    def test_an_item_line_finds_its_with(self, tracer):
        # 3.12+ enter an item from the line it starts on
        source = "with (\n    A() as a,\n    B() as b,\n):\n    v = a\n"
        assert tracer.parse(source, 3).lineno == 1

    def test_several_items_on_one_line(self, tracer):
        node = tracer.parse("with A(), B() as b:\n    v = b\n", 1)
        assert len(node.items) == 2 and body(node) == "v = b"

    def test_nested_blocks_by_their_lines(self, tracer):
        source = "with A():\n    with B():\n        inner = 1\n    outer = 2\n"
        inner = tracer.parse(source, 2)
        assert inner.lineno == 2 and body(inner) == "inner = 1"
        outer = tracer.parse(source, 1)
        assert outer.lineno == 1 and isinstance(outer.body[0], ast.With)
        assert body(outer).endswith("outer = 2")

    def test_async_with(self, tracer):
        source = "async def f():\n    async with A():\n        q = 1\n"
        node = tracer.parse(source, 2)
        assert isinstance(node, ast.AsyncWith) and body(node) == "q = 1"

    def test_block_inside_a_method_with_code_after_it(self, tracer):
        source = textwrap.dedent(
            """\
            class C:
                def f(self):
                    with A():
                        r = 1
                        s = 2
                    return r
                def g(self):
                    return 2
            """
        )
        assert body(tracer.parse(source, 3)) == "r = 1\ns = 2"

    def test_no_with_there_is_none(self, tracer):
        source = "def f():\n    a = 1\n    with A():\n        b = 2\n"
        assert tracer.parse(source, 2) is None
        assert tracer.parse(source, 4) is None  # inside the body, not a with
        assert tracer.parse(source, 99) is None

    def test_whole_text_when_the_slice_does_not_parse(self, tracer):
        # a string continued at column 0 inside the body: the slice stops too early
        source = 'def f():\n    with A():\n        s = """\nend"""\n        t = 1\n'
        node = tracer.parse(source, 2)
        assert node.lineno == 2 and [s.lineno for s in node.body] == [3, 5]


# -- build ----------------------------------------------------------------------------------
class TestBuild:
    def test_the_module_body_is_the_blocks_body(self, tracer):
        node = tracer.parse("with A():\n    a = 1\n    b = 2\n", 1)
        module = tracer.build(node)
        assert type(module) is ast.Module
        assert module.body == node.body  # the same statements, not the with line
        assert ast.unparse(module) == "a = 1\nb = 2"

    def test_missing_locations_are_filled(self, tracer):
        node = ast.With(items=[ast.withitem(context_expr=ast.Name(id="A", ctx=ast.Load()))],
                        body=[ast.Assign(targets=[ast.Name(id="x", ctx=ast.Store())],
                                         value=ast.Constant(value=3))])
        node.lineno = 1
        module = tracer.build(node)
        namespace = {}
        exec(compile(module, "<built>", "exec"), {}, namespace)  # would raise without locations
        assert namespace == {"x": 3}


# -- compile --------------------------------------------------------------------------------
class TestCompile:
    @staticmethod
    def module(tracer, text):
        return tracer.build(tracer.parse(f"with A():\n    {text}\n", 1))

    def test_exec_with_globals_and_locals(self, tracer):
        code = tracer.compile(self.module(tracer, "x = 1 + 1"), sys._getframe())
        assert isinstance(code, types.CodeType)
        variables = {}
        exec(code, {}, variables)
        assert variables == {"x": 2}

    def test_a_name_read_before_it_is_reassigned_reads_the_namespace(self, tracer):
        module = tracer.build(tracer.parse("with A():\n    y = base + 5\n    base = 99\n", 1))
        variables = {"base": 10}
        exec(tracer.compile(module, sys._getframe()), {}, variables)
        assert variables == {"base": 99, "y": 15}

    def test_named_and_filed_after_the_frame(self, tracer):
        code = tracer.compile(self.module(tracer, "raise ValueError('ran')"), sys._getframe())
        assert code.co_name == sys._getframe().f_code.co_name
        assert code.co_filename == __file__
        with pytest.raises(ValueError, match="ran") as info:
            exec(code, {}, {})
        last = traceback.extract_tb(info.value.__traceback__)[-1]
        assert (last.filename, last.lineno, last.name) == (__file__, 2, sys._getframe().f_code.co_name)

    def test_future_flags_of_the_frame(self, tracer):
        caller = {}
        exec(compile("from __future__ import annotations\nimport sys\nframe = sys._getframe()\n",
                     "<future>", "exec"), caller)
        frame = caller["frame"]  # a frame of a module with `from __future__ import annotations`
        module = tracer.build(tracer.parse("with A():\n    def g(x: undefined_name): pass\n", 1))
        namespace = {}
        exec(tracer.compile(module, frame), {}, namespace)  # annotations not evaluated
        assert namespace["g"].__annotations__ == {"x": "undefined_name"}


# -- execute --------------------------------------------------------------------------------
def test_the_default_backend_hands_execute_the_body_code():
    seen = []

    class Seeing(Tracer):
        def execute(self, code):
            seen.append(code)
            assert super().execute(code) is None

    def f(cm):
        base = 4
        unsaved = 0  # noqa: F841
        with cm() as tr:
            grown = save([base * i for i in range(3)])
            unsaved = 1  # noqa: F841
        return grown, unsaved, tr

    grown, unsaved, tr = f(Seeing)
    assert grown == f(Inline)[0] == [0, 4, 8]
    assert unsaved == 0  # at top level only the saved names come back
    (code,) = seen
    assert isinstance(code, types.CodeType) and code is tr.block.function_code(("base", "unsaved"), tr)
    assert code.co_name == "f" and code.co_filename == __file__


def test_execute_of_a_nested_trace_pushes_every_name():
    def f(cm):
        with cm():
            with cm():
                a = 1
                b = save(2)
            c = save(a + b)
        return c

    assert f(Tracer) == f(Inline) == 3


def test_execute_on_a_tracer_without_a_caller_names_what_to_do():
    import pickle

    with Tracer() as tr:
        x = save(1)  # noqa: F841
    clone = pickle.loads(pickle.dumps(tr))
    with pytest.raises(Exception, match=r"run_body\(namespace\)"):
        clone.execute(clone.body_code({}))


# -- every route runs what the steps made ---------------------------------------------------
class Doubled(Tracer):
    """`build`: after the user's statements, `value = save(value * 2)` (no location of its own)."""

    def build(self, node):
        module = super().build(node)
        extra = ast.parse("value = save(value * 2)").body[0]
        for sub in ast.walk(extra):
            for field in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
                if hasattr(sub, field):
                    delattr(sub, field)
        module.body.append(extra)
        return module


class Keep(Backend):
    def __init__(self):
        self.bodies = []

    def __call__(self, tracer):
        self.bodies.append(tracer.defer())


class RunBody(Backend):
    def __call__(self, tracer):
        tracer.push_result(tracer.run_body())


def doubled(cm, backend=None):
    start = 10
    with cm(backend=backend):
        value = save(start + 11)
    return locals().get("value")  # (None when the backend ran nothing yet)


@pytest.mark.parametrize("backend", [None, RunBody()], ids=["execute", "run_body"])
def test_a_build_override_changes_what_runs_now(backend):
    assert doubled(Inline) == 21
    assert doubled(Doubled, backend) == 42


def test_a_build_override_changes_what_a_deferred_body_runs():
    keep = Keep()
    doubled(Doubled, keep)
    (body,) = keep.bodies
    assert body.run()["value"] == 42
    assert body.run({"start": 0})["value"] == 22
    assert body.run({}, {"start": 1, "save": save}, reads_as_globals=True)["value"] == 24


def test_a_compile_override_changes_every_route():
    class Renamed(Tracer):
        def compile(self, module, frame):
            return super().compile(module, frame).replace(co_name="renamed_body")

    def f(backend=None):
        with Renamed(backend=backend):
            raise KeyError("x")

    for backend in (None, RunBody()):
        with pytest.raises(KeyError) as info:
            f(backend)
        assert traceback.extract_tb(info.value.__traceback__)[-1].name == "renamed_body"
    keep = Keep()
    f(keep)
    with pytest.raises(KeyError) as info:
        keep.bodies[0].run()
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == "renamed_body"


def test_a_parse_override_gets_the_source_and_the_with_line():
    seen = []

    class Seeing(Tracer):
        def parse(self, source, lineno):
            seen.append((type(source), lineno, source.splitlines()[lineno - 1].strip()))
            return super().parse(source, lineno)

    def f():
        with Seeing(
            backend=None,
        ):
            y = save(5)
        return y

    assert f() == 5
    assert seen == [(str, f.__code__.co_firstlineno + 1, "with Seeing(")]


def test_a_parse_override_can_decline():
    class Declining(Tracer):
        def parse(self, source, lineno):
            return None

    with pytest.raises(WithBlockNotFoundError, match="no with statement found"):
        with Declining():
            pass


def test_a_build_that_returns_no_module_is_refused():
    class Wrong(Tracer):
        def build(self, node):
            return node.body

    with pytest.raises(TypeError, match=r"Wrong.build returned list, not the ast.Module"):
        with Wrong():
            x = 1  # noqa: F841


def test_overriding_subclasses_get_their_own_cache_entries():
    def f(cm):
        value = 0
        with cm():
            value = save(value + 7)
        return value

    assert f(Tracer) == 7 and f(Doubled) == 14 and f(Tracer) == 7
    keys = {key[2] for key, (code, _) in blocks.BLOCKS.items() if code is f.__code__}
    assert keys == {None, Doubled}


def test_a_pickled_tracer_rebuilds_its_body_through_the_steps():
    import pickle

    def f():
        start = 1
        with Doubled() as tr:
            value = start + 2
        return tr, value

    tr, value = f()
    assert value == 6
    clone = pickle.loads(pickle.dumps(tr))
    assert clone.run_body({"start": 4, "save": save})["value"] == 12


# -- the old shapes, for one release ---------------------------------------------------------
def _define(source, **names):
    """Define a class from `source` (seeing this module's globals and `names`), with the
    DeprecationWarnings its definition raised."""
    namespace = dict(globals(), **names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(textwrap.dedent(source), __file__, "exec"), namespace)
    return namespace["Old"], [w for w in caught if w.category is DeprecationWarning]


def test_old_shaped_overrides_work_with_one_warning_naming_the_new_shapes():
    calls = []
    Old, caught = _define(
        """
        class Old(Tracer):
            def parse(self, lines, site):
                calls.append("parse")
                return super().parse(lines, site)

            def build(self, block, params):
                calls.append("build")
                return super().build(block, params)

            def compile(self, block, tree):
                calls.append("compile")
                return super().compile(block, tree)

            def execute(self, block, namespace=None):
                calls.append("execute")
                return super().execute(block, namespace)
        """,
        calls=calls,
    )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"{__file__}:3: Old overrides parse, build, compile, execute")
    assert (caught[0].filename, caught[0].lineno) == (__file__, 2)  # the class statement
    for shape in ("parse(self, source: str, lineno: int)", "build(self, node)",
                  "compile(self, module, frame)", "execute(self, code)"):
        assert shape in message

    def f(cm):
        base = 2
        with cm():
            out = save(base * 21)
        return out

    assert f(Old) == f(Inline) == 42
    assert calls == ["parse", "build", "compile", "execute"]
    calls.clear()
    assert f(Old) == 42 and calls == ["execute"]
    assert Old._old_steps == {"parse", "build", "compile", "execute"}


def test_an_old_build_with_a_new_compile_and_a_subclass_of_an_old_one():
    Old, caught = _define(
        """
        class Old(Tracer):
            def build(self, block, params):
                tree = super().build(block, params)
                extra = ast.parse("value = save(value * 2)").body[0]
                ast.increment_lineno(extra, block.lineno - 1)
                tree.body[0].body.insert(len(block.statements), extra)
                return tree
        """
    )
    assert len(caught) == 1 and "build(self, node) -> ast.Module" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Newer(Old):  # no warning: it overrides nothing in the old shape
            def compile(self, module, frame):
                return super().compile(module, frame)

    assert Newer._old_steps == {"build"}
    for cm in (Old, Newer):
        assert doubled(cm) == doubled(cm, RunBody()) == 42
    keep = Keep()
    doubled(Newer, keep)
    assert keep.bodies[0].run()["value"] == 42


def test_a_new_shape_override_replaces_an_inherited_old_one():
    Old, _ = _define(
        """
        class Old(Tracer):
            def execute(self, block, namespace=None):
                return super().execute(block, namespace)
        """
    )

    class New(Old):
        def execute(self, code):
            super().execute(code)

    assert Old._old_steps == {"execute"} and New._old_steps == frozenset()
    assert doubled(Old) == doubled(New) == 21
