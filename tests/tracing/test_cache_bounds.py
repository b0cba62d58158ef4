"""The capture caches stay bounded when code keeps coming, and dropping entries changes nothing.

Code compiled again and again (a notebook cell run many times, generated code) makes new call
sites forever. Each test makes many distinct sites the way IPython does (source registered in
`linecache`, code compiled under that name), with the caches' limits lowered so that a few
dozen sites overflow them, and checks both the bound and that every trace still gives what
the same block gives inline.
"""

import gc
import linecache
import weakref

import pytest

from interlace import Tracer, save
from interlace.tracing import block, blocks, sites, source

SITE = """\
def run(T, k):
    with T():
        value = save([k, {n}])
    return value
"""


@pytest.fixture
def cells():
    """`cell(text)`: compile `text` as a notebook cell with a name of its own; its namespace."""
    names = []

    def cell(text):
        name = f"<interlace-test-cell-{len(names)}-{id(names)}>"
        names.append(name)
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)  # what IPython does
        namespace = {"__name__": "cell", "save": save}
        exec(compile(text, name, "exec"), namespace)
        return namespace

    yield cell
    for name in names:
        linecache.cache.pop(name, None)
        source.SOURCES.pop(name, None)


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCKS_LIMIT", 16)
    monkeypatch.setattr(source, "TEXTS_LIMIT", 8)
    monkeypatch.setattr(sites, "DECODED_LIMIT", 8)


def inline(k, n):
    """The reference: what the cell's block computes when it runs inline."""
    return [k, n]


def test_many_sites_stay_under_the_limits_and_every_trace_is_right(cells, small):
    runs = [cells(SITE.format(n=n))["run"] for n in range(60)]
    for n, run in enumerate(runs):
        assert run(Tracer, n) == inline(n, n)
        assert len(blocks.BLOCKS) <= blocks.BLOCKS_LIMIT
        assert len(source._texts) <= source.TEXTS_LIMIT
        assert len(sites._DECODED) <= sites.DECODED_LIMIT
    # The first sites were dropped from every cache; meeting them again captures them again.
    assert not any(entry[0] is runs[0].__code__ for entry in blocks.BLOCKS.values())
    for n, run in enumerate(runs[:5]):
        assert run(Tracer, -n) == inline(-n, n)


def test_an_evicted_site_runs_its_body_once(cells, small):
    ran = []
    first = cells("def run(T, ran):\n    with T():\n        ran.append(1)\n        out = save(len(ran))\n    return out\n")["run"]
    assert first(Tracer, ran) == 1
    for n in range(40):  # push `first` out of every cache
        cells(SITE.format(n=n))["run"](Tracer, n)
    assert first(Tracer, ran) == 2
    assert ran == [1, 1]  # once per trace: never skipped-and-run-inline, never twice


def test_eviction_while_a_trace_runs_leaves_that_trace_intact(cells, small):
    """The body of the outer trace makes so many new sites that its own site is dropped from
    BLOCKS while it runs; its __exit__ still pushes the body's result."""
    inner = [cells(SITE.format(n=n))["run"] for n in range(40)]
    outer = cells(
        "def outer(T, inner):\n"
        "    with T():\n"
        "        got = save([run(T, n) for n, run in enumerate(inner)])\n"
        "    return got\n"
    )["outer"]
    assert outer(Tracer, inner) == [inline(n, n) for n in range(40)]
    assert not any(entry[0] is outer.__code__ for entry in blocks.BLOCKS.values())
    assert outer(Tracer, inner[:2]) == [inline(0, 0), inline(1, 1)]  # and it is captured again


def test_a_block_keeps_few_functions_and_lets_old_globals_go(cells):
    """The same code run with a fresh globals dict each time (exec(code, {...})): the Block's
    functions, each holding its globals, are the latest FUNCTIONS_LIMIT only."""

    class Marker:
        pass

    text = "with T():\n    value = save([k, 1])\n"
    name = "<interlace-test-exec-fresh-globals>"
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    code = compile(text, name, "exec")
    markers = []
    try:
        for k in range(30):
            namespace = {"T": Tracer, "save": save, "k": k, "marker": Marker()}
            markers.append(weakref.ref(namespace["marker"]))
            exec(code, namespace)
            assert namespace["value"] == [k, 1]
            del namespace
        (block,) = [entry[1] for entry in blocks.BLOCKS.values() if entry[0] is code]
        assert len(block.callables) <= blocks.FUNCTIONS_LIMIT
        gc.collect()
        alive = sum(ref() is not None for ref in markers)
        assert alive <= blocks.FUNCTIONS_LIMIT
        assert markers[-1]() is not None or alive == 0  # (the latest may be kept)
    finally:
        linecache.cache.pop(name, None)
        source.SOURCES.pop(name, None)


def test_files_on_disk_stay_while_other_texts_are_bounded(cells, small, tmp_path):
    path = tmp_path / "on_disk.py"
    path.write_text(SITE.format(n="'disk'"))
    namespace = {"__name__": "on_disk", "save": save}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    assert namespace["run"](Tracer, 1) == [1, "disk"]
    try:
        for n in range(3 * source.TEXTS_LIMIT):
            cells(SITE.format(n=n))["run"](Tracer, n)
        assert str(path) in source.SOURCES
        assert sum(1 for name in source.SOURCES if name.startswith("<interlace-test-cell-")) <= source.TEXTS_LIMIT
    finally:
        source.SOURCES.pop(str(path), None)


@pytest.mark.native_only  # the twin refuses a tracer that is not the last item
def test_a_multi_item_body_is_described_exactly_as_long_as_its_code_lives(cells, small):
    """`with T(), U():` compiles T's body as `with U(): body`; the note that says so lives
    as long as that code, so the caches let it go with the Block."""
    text = (
        "import contextlib\n"
        "def run(T, k):\n"
        "    with T(), contextlib.nullcontext():\n"
        "        value = save([k, {n}])\n"
        "    return value\n"
    )
    for n in range(40):
        assert cells(text.format(n=n))["run"](Tracer, n) == inline(n, n)
    gc.collect()
    held = set()  # the body codes the Blocks still in BLOCKS hold
    for _, verdict in blocks.BLOCKS.values():
        if type(verdict) is blocks.Block:
            held.update(id(code) for code in verdict._functions.values())
            held.update(id(function.__code__) for function in verdict.callables.values())
    ours = [key for key, entry in block.SYNTHETIC.items()
            if entry[0]() is not None and entry[0]().co_filename.startswith("<interlace-test-cell-")]
    assert 0 < len(ours) <= blocks.BLOCKS_LIMIT
    assert set(ours) <= held


def test_a_dropped_site_lets_its_code_and_block_go(cells, small):
    """Once the program drops a cell's function and BLOCKS drops its site, nothing of ours keeps
    the code object (or the Block, its compiled body, the cell's globals) alive."""
    codes = []
    for n in range(40):
        run = cells(SITE.format(n=n))["run"]
        assert run(Tracer, n) == inline(n, n)
        codes.append(weakref.ref(run.__code__))
        del run
    gc.collect()
    alive = sum(ref() is not None for ref in codes)
    assert alive <= blocks.BLOCKS_LIMIT + sites.DECODED_LIMIT
