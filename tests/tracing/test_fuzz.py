"""Differential fuzz test: generated programs, traced versus run inline.

Each seed generates a small program whose traced blocks take many shapes: headers (plain,
`as`, parenthesised, multi-line, body on the `with` line, other context managers before or
after the tracer, two tracers in one `with`, `async with`), bodies (a `try` first, nested
traces, loops, comprehensions, lambdas, walrus, caught exceptions, `del`, attribute
stores, a body that raises), and places (functions, loops, generators, coroutines,
closures with cells and `nonlocal`, methods, class bodies, module level). The program is
written to a file (interlace reads sources) and run twice:

* traced: `T` is `interlace.Tracer` (default Backend) and `save` is `interlace.save`;
* inline: `T` is `contextlib.nullcontext` and `save` returns its argument.

The program saves every name it reads after a block, so both runs must end in the same
`RESULT` (returned values and `LOG`, the ordered side effects). Each block runs at least
twice, so warm call sites are covered as well as cold ones. Natively every program must run;
the pure-Python twin may refuse a program with `UnsupportedBlockError` only if it contains a
shape the twin cannot skip (body on the `with` line, another item after the tracer, a `try`
first), and must never diverge. Seeds are fixed: a failure prints the program.
"""

import contextlib
import random
import sys

import pytest

import interlace
from interlace import Tracer, UnsupportedBlockError, save

pytestmark = pytest.mark.slow  # random programs by the hundred: `make test` runs them, `make check` does not

PROGRAMS = 192  # a few seconds per interpreter and path
KINDS = ("function", "loop", "generator", "async", "closure", "method", "class", "module")

PRELUDE = '''\
import asyncio
LOG = []


class Plain:
    def __init__(self, tag):
        self.tag = tag

    def __enter__(self):
        LOG.append(("enter", self.tag))
        return self

    def __exit__(self, *exc):
        LOG.append(("exit", self.tag))
        return False

    async def __aenter__(self):
        return self.__enter__()

    async def __aexit__(self, *exc):
        return self.__exit__(*exc)


def helper(v):
    return v * 3 + 1


def drive(coro):
    try:
        while True:
            coro.send(None)
    except StopIteration as stop:
        return stop.value
'''


def _indent(lines, n=1):
    return ["    " * n + line for line in lines]


class Generator:
    """One program from one seed. `twin_safe` programs avoid every shape the twin refuses."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.seed = seed
        self.count = 0
        self.twin_safe = self.rng.random() < 0.5
        self.lists = set()  # exported names holding lists (not usable in int expressions)

    def fresh(self, prefix):
        self.count += 1
        return f"{prefix}{self.count}"

    # -- expressions over int-valued names ------------------------------------------------
    def expr(self, names, scoped=True):
        """An int expression. `scoped=False` (class bodies): no lambdas or comprehensions,
        which cannot see a class body's names inline."""
        r = self.rng
        a = r.choice(names) if names else str(r.randint(1, 9))
        b = r.choice(names) if names else str(r.randint(1, 9))
        c, k = r.randint(1, 9), r.randint(1, 4)
        forms = [
            f"{a} + {c}", f"{a} * {c} - {b}", f"max({a}, {b})", f"helper({a})",
            f"({a} if {b} > {c} else {c})", f"abs({a} - {b}) + {c}",
        ]
        if scoped:
            forms += [
                f"sum([{a} * i for i in range({k})])", f"(lambda z: z + {a})({c})",
                f"sum({a} + i for i in range({k}))", f"{{i: {a} + i for i in range(3)}}[{k % 3}]",
                f"len({{{a}, {b}, {c}}})",
            ]
        return r.choice(forms)

    # -- bodies ---------------------------------------------------------------------------
    def simple(self, names, exported, ctx):
        """One simple statement (fits on a `with` line)."""
        r = self.rng
        e = self.expr(names, ctx["scoped"])
        kind = r.choice(("save", "save", "temp", "log"))
        if kind == "save":
            name = self.fresh("n")
            names.append(name)
            exported.append(name)
            return f"{name} = save({e})"
        if kind == "temp":
            name = self.fresh("t")
            names.append(name)
            return f"{name} = {e}"
        return f"LOG.append({e})"

    def statement(self, names, exported, ctx, depth):
        r = self.rng
        kinds = ["simple"] * 4 + ["if", "for", "try", "caught", "del"]
        if ctx["scoped"]:
            kinds.append("walrus")
        if depth < 2:
            kinds += ["nested"] * 2
        if ctx.get("self"):
            kinds.append("attr")
        if ctx.get("nonlocal"):
            kinds.append("nonlocal")
        kind = r.choice(kinds)
        e = self.expr(names, ctx["scoped"])
        if kind == "simple":
            return [self.simple(names, exported, ctx)]
        name = self.fresh("n")
        if kind == "if":
            lines = [f"if {r.choice(names) if names else 1} > {r.randint(1, 9)}:",
                     f"    {name} = save({e})", "else:", f"    {name} = save({self.expr(names, ctx['scoped'])})"]
        elif kind == "for":
            i = self.fresh("i")
            lines = [f"{name} = save({e})", f"for {i} in range({r.randint(0, 3)}):",
                     f"    {name} = save({name} + {i})"]
        elif kind == "try":
            lines = ["try:", f"    {name} = save(({e}) // 0)", "except ZeroDivisionError:",
                     f"    {name} = save(-{r.randint(1, 9)})"]
        elif kind == "caught":
            lines = ["try:", f"    raise ValueError({e})", "except ValueError as err:",
                     f"    {name} = save(err.args[0])"]
        elif kind == "del":
            lines = [f"{name} = {e}", f"LOG.append({name})", f"del {name}"]
            return lines  # not exported: unbound after the block, inline and traced
        elif kind == "walrus":
            w = self.fresh("w")
            lines = [f"{name} = save([({w} := i + {r.choice(names) if names else 1}) for i in range(2)])"]
            exported.append(name)  # a list: exported, but not an int name
            self.lists.add(name)
            return lines
        elif kind == "attr":
            return [f"self.v = {e}"]
        elif kind == "nonlocal":
            exported.append("count")
            return [f"count = save(count + {e})"]
        else:  # nested trace, sometimes as the first statement of its own body
            header = r.choice(("with T():", "with T() as inner:"))
            inner = self.body(list(names), ctx, depth + 1, try_first=False)
            names += [n for n in inner[1] if n not in self.lists]
            exported += inner[1]  # an inner trace pushes everything; saves are shared
            return [header] + _indent(inner[0])
        names.append(name)
        exported.append(name)
        return lines

    def body(self, names, ctx, depth, try_first):
        """(lines, exported names) of a block body over the int names `names`."""
        r = self.rng
        names = list(names)
        initial = list(names)
        exported = []
        lines = []
        if depth < 2 and r.random() < 0.25:  # an inner trace as the very first statement
            header = "with T():"
            inner = self.body(list(names), ctx, depth + 1, try_first=False)
            names += [n for n in inner[1] if n not in self.lists]
            exported += inner[1]
            lines += [header] + _indent(inner[0])
        for _ in range(r.randint(1, 4)):
            lines += self.statement(names, exported, ctx, depth)
        if self.twin_safe and lines[0].startswith("try:"):
            lines.insert(0, self.simple(initial, exported, ctx))  # the twin refuses a `try` first
        if try_first:
            handler = r.choice((
                ["except ValueError:", "    LOG.append('never')"],
                ["except ValueError:", "    pass", "else:", "    LOG.append('else')"],
                ["finally:", "    LOG.append('finally')"],
                ["except:  # noqa: E722", "    LOG.append('bare')", "    raise"],
            ))
            lines = ["try:"] + _indent(lines) + handler
        return lines, [n for n in exported]

    # -- one traced block -----------------------------------------------------------------
    def block(self, names, ctx, post):
        """Lines of one traced block followed by `post(exported_int_names, all_exported)`,
        the code that reads what the block saved."""
        r = self.rng
        safe = self.twin_safe
        async_ = ctx.get("async") and r.random() < 0.7
        try_first = not safe and r.random() < 0.3
        # (a `try`-first body that always raises has no normal exit to jump to and cannot be
        # raised past: refused everywhere, see test_refusals)
        raising = not try_first and r.random() < 0.12
        headers = ["with T():", "with T() as tr:", "with (T() as tr):", "with (T() as tr,):",
                   "multi-line", "with Plain('before'), T():"]
        if not safe:
            headers += ["same-line", "with T(), Plain('after'):", "with T(), T():"]
        if async_:
            headers = ["async with T():", "async with T() as tr:", "async with Plain('before'), T():"]
            if not safe:
                headers.append("async-same-line")
        header = r.choice(headers)
        if header in ("same-line", "async-same-line"):
            exported = []
            local = list(names)
            stmts = [self.simple(local, exported, ctx) for _ in range(r.randint(1, 3))]
            if raising:
                stmts.append(f"raise KeyError({self.expr(local, ctx['scoped'])})")
            keyword = "async with" if header == "async-same-line" else "with"
            lines = [f"{keyword} T(): " + "; ".join(stmts)]
        else:
            body, exported = self.body(names, ctx, 0, try_first)
            if raising:
                if body[0].startswith("try:"):  # see try_first above
                    body.insert(0, "LOG.append('first')")
                body.append(f"raise KeyError({self.rng.randint(1, 99)})")
            if header == "multi-line":
                head = ["with (", "    T()", "    as tr", "):"]
            else:
                head = [header]
            lines = head + _indent(body)
        if raising:  # nothing the body assigned is read after it
            return ["try:"] + _indent(lines) + ["except KeyError as err:",
                                                "    LOG.append(('caught', err.args))"] + post([], [])
        ints = [n for n in exported if n not in self.lists]
        return lines + post(ints, exported)

    # -- places ---------------------------------------------------------------------------
    def reads(self, ints, exported):
        """An expression reading what a block saved (fused pairs on 3.13 included)."""
        parts = list(exported)
        if len(ints) >= 2:
            parts.append(f"{ints[0]} + {ints[-1]}")
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")" if parts else "()"

    def program(self, kind):
        ctx = {"scoped": True}
        r = self.rng
        if kind == "function":
            blocks = []
            names = ["x", "y", "a0"]
            for _ in range(r.randint(1, 2)):
                blocks += self.block(names, ctx, lambda i, e: [f"LOG.append({self.reads(i, e)})"])
            code = ["def main(x, y):", "    a0 = x + 1"] + _indent(blocks) + ["    return len(LOG)"]
            calls = "[main(1, 2), main(5, 3)]"
        elif kind == "loop":
            blocks = self.block(["x", "y", "it"], ctx, lambda i, e: [f"out.append({self.reads(i, e)})"])
            code = ["def main(x, y):", "    out = []", "    for it in range(3):"] + _indent(blocks, 2) + [
                "    return out"]
            calls = "[main(1, 2), main(4, 0)]"
        elif kind == "generator":
            blocks = self.block(["x", "y", "it"], ctx, lambda i, e: [f"yield {self.reads(i, e)}"])
            code = ["def gen(x, y):", "    for it in range(2):"] + _indent(blocks, 2) + [
                "        LOG.append(('resumed', it))", "", "", "def main(x, y):", "    return list(gen(x, y))"]
            calls = "[main(1, 2), main(3, 7)]"
        elif kind == "async":
            ctx = dict(ctx, **{"async": True})
            blocks = self.block(["x", "y"], ctx, lambda i, e: [f"result = {self.reads(i, e)}"])
            code = ["async def coro(x, y):", "    await asyncio.sleep(0)", "    result = None"] + _indent(
                blocks) + ["    await asyncio.sleep(0)", "    return result", "", "",
                           "def main(x, y):", "    return drive(coro(x, y))"]
            calls = "[main(1, 2), main(6, 2), main(2, 9)]"
        elif kind == "closure":
            use_nonlocal = r.random() < 0.5
            ctx = dict(ctx, **{"nonlocal": use_nonlocal})
            names = ["base", "z"] + (["count"] if use_nonlocal else [])
            blocks = self.block(names, ctx, lambda i, e: [f"return (lambda: {self.reads(i, e)})()"])
            code = ["def main(x, y):", "    base = x * 2", "    count = y", "", "    def inner(z):"]
            if use_nonlocal:
                code.append("        nonlocal count")
            code += _indent(blocks, 2) + ["        return None", "",
                                          "    return [inner(1), inner(2), count]"]
            calls = "[main(1, 2), main(3, 1)]"
        elif kind == "method":
            ctx = dict(ctx, self=True)
            blocks = self.block(["x", "sv"], ctx, lambda i, e: [f"return {self.reads(i, e)}, self.v"])
            code = ["class Box:", "    def __init__(self, v):", "        self.v = v", "",
                    "    def run(self, x):", "        sv = self.v"] + _indent(blocks, 2) + [
                "        return None, self.v", "", "", "def main(x, y):", "    box = Box(y)",
                "    return [box.run(x), box.run(x + 1), box.v]"]
            calls = "[main(1, 2), main(3, 4)]"
        elif kind == "class":
            ctx = {"scoped": False}
            blocks = self.block(["k0"], ctx, lambda i, e: [f"after = {self.reads(i, e)}"])
            code = ["G = 5", "", "", "def main(x, y):", "    class C:", "        k0 = G + x", "        after = None"
                    ] + _indent(blocks, 2) + ["    return C.after, C.k0"]
            calls = "[main(1, 2), main(3, 4)]"
        else:  # module level: once straight, then twice in a loop (a warm site)
            first = self.block(["G1"], ctx, lambda i, e: [f"M_AFTER = {self.reads(i, e)}"])
            loop = self.block(["G1", "it"], ctx, lambda i, e: [f"M_LOOP.append({self.reads(i, e)})"])
            code = ["G1 = 7", "M_AFTER = None", "M_LOOP = []"] + first + ["for it in range(2):"] + _indent(loop)
            calls = "[M_AFTER, M_LOOP]"
        return PRELUDE + "\n\n" + "\n".join(code) + f"\n\n\nRESULT = ({calls}, LOG)\n"


def _identity(value):
    return value


def _run(source, path, traced):
    namespace = {
        "__name__": "interlace_fuzz_program",
        "T": Tracer if traced else contextlib.nullcontext,
        "save": save if traced else _identity,
    }
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - generated test program
    return namespace["RESULT"]


@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_generated_program_traced_equals_inline(seed, tmp_path):
    kind = KINDS[seed % len(KINDS)]
    generator = Generator(seed)
    source = generator.program(kind)
    path = tmp_path / f"fuzz_{kind}_{seed}.py"
    path.write_text(source)
    expected = _run(source, path, traced=False)
    try:
        got = _run(source, path, traced=True)
    except UnsupportedBlockError as error:
        if interlace.native or generator.twin_safe:
            pytest.fail(f"refused ({'native' if interlace.native else 'twin-safe program'}): "
                        f"{error}\n--- program (seed {seed}, {kind}) ---\n{source}")
        return  # the twin may refuse the shapes it cannot skip
    except BaseException as error:
        raise AssertionError(f"traced run failed: {type(error).__name__}: {error}\n"
                             f"--- program (seed {seed}, {kind}) ---\n{source}") from error
    assert got == expected, f"traced != inline\n--- program (seed {seed}, {kind}) ---\n{source}"


def test_the_fuzz_covers_every_place_and_both_program_families():
    """The generator is not vacuous: every kind of place, twin-safe programs and programs
    with the shapes only the native path takes, with traced blocks, appear in the seeds."""
    seen = set()
    for seed in range(PROGRAMS):
        generator = Generator(seed)
        source = generator.program(KINDS[seed % len(KINDS)])
        assert "with T()" in source or "with (" in source or "with Plain('before'), T()" in source
        seen.add((KINDS[seed % len(KINDS)], generator.twin_safe))
        for shape in ("async with T()", "with T(), Plain", "with T(): ", "try:", "with T(), T():"):
            if shape in source:
                seen.add(shape)
    assert {(k, safe) for k in KINDS for safe in (True, False)} <= seen
    assert {"async with T()", "with T(), Plain", "with T(): ", "try:", "with T(), T():"} <= seen
    assert sys.version_info >= (3, 10)
