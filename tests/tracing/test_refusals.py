"""Shapes refused at capture time: `UnsupportedBlockError` naming file:line and a rewrite.

A refused body never runs, neither inline nor through the backend.
"""

import textwrap

import pytest

from interlace import InterlaceError, Tracer, UnsupportedBlockError, save


def compile_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    namespace = {"ran": []}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace, str(path)


CASES = {
    "return": (
        """
        def f():
            with Tracer():
                ran.append(1)
                return 1
        """,
        5,
        ["`return` inside the traced block at line 4", "`return result` after the with block"],
    ),
    "return_nested_in_if": (
        """
        def f(x=True):
            with Tracer():
                ran.append(1)
                if x:
                    return 1
        """,
        6,
        ["`return`", "save"],
    ),
    "yield": (
        """
        def f():
            with Tracer():
                ran.append(1)
                yield 1
        """,
        5,
        ["`yield` inside the traced block at line 4", "yield them after the with block"],
    ),
    "yield_from": (
        """
        def f():
            with Tracer():
                ran.append(1)
                yield from [1]
        """,
        5,
        ["`yield from`", "after the with block"],
    ),
    "break": (
        """
        def f():
            for i in range(3):
                with Tracer():
                    ran.append(1)
                    break
        """,
        6,
        ["`break` inside the traced block at line 5", "`break` after the with block"],
    ),
    "continue_in_loop_else": (
        """
        def f():
            for i in range(3):
                with Tracer():
                    for j in range(2):
                        pass
                    else:
                        continue
        """,
        8,
        ["`continue`", "`continue` after the with block"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_escaping_statements_are_refused_at_capture(tmp_path, case):
    text, line, phrases = CASES[case]
    namespace, path = compile_file(tmp_path, f"refuse_{case}.py", "from interlace import Tracer\n" + textwrap.dedent(text))
    with pytest.raises(UnsupportedBlockError) as info:
        result = namespace["f"]()
        if hasattr(result, "__next__"):
            next(result)
    message = str(info.value)
    assert message.startswith(f"{path}:{line + 1}: ")
    for phrase in phrases:
        assert phrase in message
    assert namespace["ran"] == []  # the body ran neither inline nor in a backend
    assert isinstance(info.value, InterlaceError)


@pytest.fixture
def run_refused(tmp_path):
    def run(name, text):
        namespace, path = compile_file(tmp_path, name, "from interlace import Tracer\n" + textwrap.dedent(text))
        with pytest.raises(UnsupportedBlockError) as info:
            result = namespace["f"]()
            if hasattr(result, "send"):
                result.send(None)
        assert namespace["ran"] == []
        return str(info.value), path

    return run


def test_return_message_names_file_line_shape_and_rewrite(run_refused):
    message, path = run_refused(
        "ret.py",
        """
        def f():
            with Tracer():
                ran.append(1)
                return 1
        """,
    )
    assert message == (
        f"{path}:6: `return` inside the traced block at line 4 (in f()) cannot be traced: the body "
        "runs later, outside f()'s frame, so it cannot return from it. Save the value inside the "
        "block (`result = value.save()`) and `return result` after the with block."
    )


def test_await_directly_in_the_body_is_refused(run_refused):
    message, path = run_refused(
        "awaiting.py",
        """
        import asyncio
        async def f():
            with Tracer():
                ran.append(1)
                await asyncio.sleep(0)
        """,
    )
    assert message.startswith(f"{path}:7: `await` inside the traced block at line 5 (in f())")
    assert "Await what you need before the with block" in message


@pytest.mark.parametrize(
    "statement, shape",
    [
        ("async for x in agen():\n                    pass", "async for"),
        ("async with actx():\n                    pass", "async with"),
        ("y = [x async for x in agen()]", "async for"),
    ],
)
def test_async_statements_in_the_body_are_refused(run_refused, statement, shape):
    message, _ = run_refused(
        f"async_{abs(hash(statement))}.py",
        f"""
        async def f():
            with Tracer():
                ran.append(1)
                {statement}
        """,
    )
    assert f"`{shape}` inside the traced block" in message


def test_escapes_inside_nested_scopes_and_body_loops_are_fine():
    def f():
        with Tracer():

            def helper():
                for i in range(3):
                    if i:
                        return i
                yield 0

            class K:
                def m(self):
                    return 5

            out = []
            for i in range(4):
                if i == 1:
                    continue
                if i == 3:
                    break
                out.append(i)
            while True:
                break
            gen = (lambda: (yield))
            got = save((list(helper()), K().m(), out, callable(gen)))
        return got

    assert f() == ([], 5, [0, 2], True)


def test_an_unsaved_name_read_after_the_block_raises_naming_it():
    def f():
        for _ in range(2):
            with Tracer():
                unsaved_name = 1
        return unsaved_name

    with pytest.raises(UnboundLocalError, match="unsaved_name"):
        f()


def test_a_refused_site_stays_refused_and_never_runs(run_refused, tmp_path):
    namespace, _ = compile_file(
        tmp_path,
        "refused_twice.py",
        """
        from interlace import Tracer
        def f():
            with Tracer():
                ran.append(1)
                return 1
        """,
    )
    for _ in range(3):
        with pytest.raises(UnsupportedBlockError):
            namespace["f"]()
    assert namespace["ran"] == []


@pytest.mark.native_only
def test_a_try_first_body_that_always_raises_is_refused_with_a_rewrite(run_refused):
    # Every path raises, so there is no normal exit to jump to, and raising at the body
    # start would run the `try`'s handlers (3.11+: its first instruction is outside the
    # with's exception range). A statement before the `try` makes it skippable by raising.
    message, path = run_refused(
        "always_raises.py",
        """
        def f():
            with Tracer():
                try:
                    ran.append(1)
                finally:
                    ran.append(2)
                raise KeyError(3)
        """,
    )
    assert message.startswith(f"{path}:4: cannot skip this `with` body: its first statement is a `try`")
    assert "every path raises" in message
    assert "Put a statement before the `try`" in message
