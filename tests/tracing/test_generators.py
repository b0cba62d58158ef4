"""The generator rewrite of a captured body (tracing/generators.py), torch-free.

What must hold on every supported Python (comprehensions are inlined on 3.12+, PEP 709):
a body is proved fit only when every read is in its own frame; the rewritten body makes the
same reads and writes, in the same order, with the same values, as the body run inline; an
object without the read protocol is read and assigned exactly as inline, with no yield.
"""

import ast
import builtins

import pytest

from interlace.tracing import generators

FIT = [
    "x = m.output",
    "m.output = 1",
    "m.output[:] = 0",
    "print(m.output.save())",
    "for layer in layers:\n    seen.append(layer.output)",
    "if flag:\n    y = m.inputs\nelse:\n    y = m.input",
    "try:\n    y = m.output\nexcept KeyError:\n    y = None",
    "y = f'{m.output}'",
    "y = tracer.result",
    "h = [1, 2]\nz = [v * 2 for v in h]",  # a comprehension that reads nothing
    "y = [m.output for m in ms]",  # comprehensions that become loops of the body's own
    "y = {m.input for m in ms if m}",
    "y = {k: m.inputs for k, m in ms}",
    "[m.output.save() for m in ms]",
    "interlace.save([m.output for m in ms])",
    "y = save([(i, m.output) for i, m in enumerate(ms) for j in range(2) if j])",
    "f = lambda v: v + 1",  # a lambda that reads nothing
]

REFUSED = {
    "with t:\n    pass": "`with` statement",
    "f = lambda: m.output": "lambda",
    "y = list(m.output for m in ms)": "generator expression",
    "y = len([m.output for m in ms]) + 1": "comprehension not made a loop",
    "y = f(a, [m.output for m in ms])": "comprehension not made a loop",
    "y = f()([m.output for m in ms])": "comprehension not made a loop",
    "y = [(n := m.output) for m in ms]": "comprehension not made a loop",
    "y = [[m.output for m in ms] for ms in mss]": "comprehension not made a loop",
    "y = [m.output for m.x in ms]": "comprehension not made a loop",
    "def f():\n    return m.output": "nested function",
    "class C:\n    y = m.output": "class",
    "m.output += 1": "assigned or deleted",
    "a, m.output = 1, 2": "assigned or deleted",
    "a = m.output = 1": "assigned or deleted",
    "del m.output": "assigned or deleted",
    "for m.output in xs:\n    pass": "assigned or deleted",
    "for i in tracer.iter[0:2]:\n    pass": "`.iter`",
    "b = tracer.barrier(2)": "`.barrier`",
    "g = x.grad": "`.grad`",
    "m.skip(0)": "`.skip`",
    "tracer.stop()": "`.stop`",
    "y = m.source.attn.output": "`.source`",
}


def _statements(source):
    return ast.parse(source).body


@pytest.mark.parametrize("source", FIT)
def test_bodies_whose_reads_are_all_in_their_own_frame_are_fit(source):
    assert generators.refusal(_statements(source)) is None


@pytest.mark.parametrize("source", sorted(REFUSED))
def test_bodies_with_a_read_elsewhere_or_an_unserved_wait_are_refused_with_the_line(source):
    reason = generators.refusal(_statements(source))
    assert reason is not None and REFUSED[source] in reason, reason
    assert reason.startswith("line ")


class Readable:
    """An object with the read protocol: each read yields ("read", name) and gets its value
    from the driver; each write yields ("write", name, value)."""

    def __init__(self, log):
        self.log = log

    def __interlace_read__(self, name):
        value = yield ("read", name)
        self.log.append(("read", name, value))
        return value

    def __interlace_write__(self, name, value):
        yield ("write", name, value)
        self.log.append(("write", name, value))


def _body_function(source, params):
    """The body as `syntax.function_module` shapes it, rewritten, compiled, with its helpers."""
    module = ast.parse(
        f"def body({', '.join(params)}, __interlace_locals__):\n"
        + "".join(f"    {line}\n" for line in source.splitlines())
        + "    return __interlace_locals__()\n"
    )
    rewritten, points = generators.rewrite(module)
    namespace = {}
    exec(compile(rewritten, "<body>", "exec"), namespace)
    body = namespace["body"]
    body.__defaults__ = (builtins.locals, *generators.DEFAULTS)
    return body, points


def _drive(gen, answers):
    """Run a generator body to its end, answering each read from `answers`; the yields seen
    and its final locals."""
    seen = []
    payload = None
    while True:
        try:
            request = gen.send(payload)
        except StopIteration as end:
            return seen, end.value
        seen.append(request)
        payload = answers.pop(0) if request[0] == "read" else None


def test_a_rewritten_body_reads_and_writes_in_the_inline_order_with_the_inline_values():
    source = (
        "order.append('start')\n"
        "x = m.output + 1\n"
        "m.output = (order.append('value'), x * 2)[1]\n"
        "m.output[0] = (order.append('item'), 7)[1]\n"
        "y = m.inputs\n"
        "z = [v for v in range(3)]\n"
    )
    body, points = _body_function(source, ["m", "order"])
    assert points == 4
    log, order = [], []
    seen, values = _drive(body(Readable(log), order), [10, [0, 0], ("args", {})])
    assert seen == [("read", "output"), ("write", "output", 22), ("read", "output"),
                    ("read", "inputs")]
    # the assigned value is computed before the write, as `m.output = v` evaluates it
    assert order == ["start", "value", "item"]
    assert values["x"] == 11 and values["y"] == ("args", {}) and values["z"] == [0, 1, 2]
    assert not set(generators.HIDDEN) - set(values)  # the caller drops them (deferred.py)


def test_objects_without_the_protocol_are_read_and_assigned_as_inline_with_no_yield():
    class Plain:
        output = 3

    source = "a = p.output\np.output = a + 1\nb = p.output\nr = p.result if hasattr(p, 'result') else None\n"
    body, points = _body_function(source, ["p"])
    plain = Plain()
    seen, values = _drive(body(plain), [])
    assert seen == [] and values["a"] == 3 and values["b"] == 4 and plain.output == 4


def test_an_error_in_a_read_is_raised_at_the_read_line_of_the_body():
    class Failing:
        def __interlace_read__(self, name):
            yield ("read", name)
            raise KeyError(name)

    body, _ = _body_function("x = 1\ny = f.output\nz = 2\n", ["f"])
    gen = body(Failing())
    assert gen.send(None) == ("read", "output")
    with pytest.raises(KeyError) as info:
        gen.send(5)
    lines = [tb.tb_lineno for tb in _frames(info.value.__traceback__) if tb.tb_frame.f_code.co_name == "body"]
    assert lines == [3]  # `def body` is line 1: the read is the body's second statement


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


COMPREHENSIONS = [
    "y = [m.output * 2 for m in ms if m.output > 1]",
    "y = {m.output % 3 for m in ms}",
    "y = {i: m.output for i, m in enumerate(ms) if i != 1}",
    "y = [(m.output, k) for m in ms for k in range(m.output) if k % 2 == 0]",
    "y = save([m.output for m in ms])",
    "[log.append(m.output) for m in ms]",
]


class Value:
    """Its `output` is read through the protocol (a yield each) and counted."""

    def __init__(self, value, reads):
        self.value = value
        self.reads = reads

    @property
    def output(self):  # the inline read
        self.reads.append(self.value)
        return self.value

    def __interlace_read__(self, name):
        yield ("read", name)
        return getattr(self, name)


@pytest.mark.parametrize("source", COMPREHENSIONS)
def test_a_comprehension_made_a_loop_gives_the_inline_values_reads_and_names(source):
    """Same values, same reads in the same order, and no comprehension variable (nor any
    temporary) left among the body's names, as the comprehension inline (PEP 709 inlines it
    on 3.12+, a function of its own before: either way its names are its own)."""
    assert generators.refusal(_statements(source)) is None
    inline_reads, log_inline = [], []
    ms = [Value(v, inline_reads) for v in (1, 2, 3, 4)]
    m = "outer"
    inline = {"ms": ms, "m": m, "save": lambda v: v, "log": log_inline}
    exec(source, inline)

    body, points = _body_function(source, ["ms", "m", "save", "log"])
    assert points >= 1
    gen_reads, log_gen = [], []
    ms2 = [Value(v, gen_reads) for v in (1, 2, 3, 4)]
    seen, values = _drive(body(ms2, m, lambda v: v, log_gen), [None] * 100)
    assert len(seen) == len(gen_reads) == len(inline_reads) and gen_reads == inline_reads
    assert values.get("y") == inline.get("y") and log_gen == log_inline
    assert values["m"] == "outer"  # the loop variable did not leak into the body's names
    assert not [name for name in values if name.startswith("__interlace_loop")]


def test_the_rewrite_leaves_the_blocks_own_statements_untouched():
    module = ast.parse("def body(m, __interlace_locals__):\n    x = m.output\n    return __interlace_locals__()\n")
    before = ast.dump(module)
    generators.rewrite(module)
    assert ast.dump(module) == before
