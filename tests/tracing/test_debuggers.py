"""pdb and a user's own sys.settrace keep working through and after a trace (native path).

The native skip never installs a Python-visible trace function and never writes f_lineno,
so a debugger sees an unbroken stream of events in the caller's frame: exactly the events
of the same block run inline, minus the body's lines (which run, and are traced, in the
backend's code object under the same file and line numbers).
"""

import dis
import os
import subprocess
import sys
import textwrap

import pytest

from interlace import Tracer, save


class Inline:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def program(T, save):
    with T():
        h = save(1)
    a = h + 1
    with T(): b = save(a + 1)  # noqa: E701
    with T():
        try:
            c = save(b + 1)
        finally:
            pass
    d = c + 1
    return d


def simple_program(T, save):
    with T():
        h = save(1)
    a = h + 1
    with T():
        b = save(a + 1)
    return b


BODY_LINES = {2, 6, 7, 8, 9}  # relative to `def program` (line 4 holds a same-line body)


def traced_lines(T, save_fn):
    first = program.__code__.co_firstlineno
    events = []

    def tracer(frame, event, arg):
        if frame.f_code is program.__code__:
            events.append((event, frame.f_lineno - first))
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        result = program(T, save_fn)
    finally:
        sys.settrace(old)
    return result, events


@pytest.mark.native_only
def test_user_settrace_keeps_receiving_lines_after_the_block():
    got_result, got = traced_lines(Tracer, save)
    want_result, want = traced_lines(Inline, lambda x: x)
    assert got_result == want_result == 5

    # Body lines run (and are traced) in the backend's code object. On 3.12+ the with
    # line's second event (the __exit__ call) is not re-emitted, sys.settrace (tool 7) sees
    # the body's first line before our tool jumps, and a body on the with line is skipped
    # by raising, which a tracer sees as an 'exception' event.
    def outside(events):
        return [e for e in events if e[0] != "exception" and e[1] not in BODY_LINES | {1, 5}]

    assert outside(got) == outside(want)
    assert outside(got) == [("call", 0), ("line", 3), ("line", 4), ("line", 10), ("line", 11), ("return", 11)]
    if sys.version_info < (3, 12):
        # the C trace function consumes only the body start: the stream is the inline one
        # without the body's lines, including the with line's second event at the exit
        assert got == [e for e in want if e[1] not in BODY_LINES]


def test_trace_and_profile_state_is_exactly_as_before():
    def tracer(frame, event, arg):
        return None

    def profiler(frame, event, arg):
        return None

    old_trace, old_profile = sys.gettrace(), sys.getprofile()
    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        assert simple_program(Tracer, save) == 3
        assert sys.gettrace() is tracer
        assert sys.getprofile() is profiler
    finally:
        sys.settrace(old_trace)
        sys.setprofile(old_profile)
    assert simple_program(Tracer, save) == 3
    assert sys.gettrace() is old_trace and sys.getprofile() is old_profile


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring is 3.12+")
def test_other_monitoring_tools_are_left_alone():
    mon = sys.monitoring
    tool = 1 if mon.get_tool(1) is None else 0
    mon.use_tool_id(tool, "a-test-tool")
    seen = []
    try:
        mon.register_callback(tool, mon.events.LINE, lambda code, line: seen.append(line))
        mon.set_local_events(tool, simple_program.__code__, mon.events.LINE)
        before = (mon.get_events(tool), mon.get_local_events(tool, simple_program.__code__))
        assert simple_program(Tracer, save) == 3
        assert (mon.get_events(tool), mon.get_local_events(tool, simple_program.__code__)) == before
        first = simple_program.__code__.co_firstlineno
        assert {first + 3, first + 6} <= set(seen)
    finally:
        mon.set_local_events(tool, simple_program.__code__, 0)
        mon.register_callback(tool, mon.events.LINE, None)
        mon.free_tool_id(tool)


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring is 3.12+")
def test_another_tools_instruction_events_continue_after_the_block():
    mon = sys.monitoring
    tool = 1 if mon.get_tool(1) is None else 0
    mon.use_tool_id(tool, "a-test-tool")
    seen = []
    code = simple_program.__code__
    try:
        mon.register_callback(tool, mon.events.INSTRUCTION, lambda c, offset: seen.append((c, offset)))
        mon.set_local_events(tool, code, mon.events.INSTRUCTION)
        for _ in range(3):
            seen.clear()
            assert simple_program(Tracer, save) == 3
            offsets = [offset for c, offset in seen if c is code]
            returns = [i.offset for i in dis.get_instructions(code) if i.opname.startswith("RETURN")]
            assert set(returns) & set(offsets), "no instruction events after the blocks"
    finally:
        mon.set_local_events(tool, code, 0)
        mon.register_callback(tool, mon.events.INSTRUCTION, None)
        mon.free_tool_id(tool)


PDB_SCRIPT = textwrap.dedent(
    """\
    from interlace import Tracer, save

    def f():
        with Tracer():
            h = save(20)
        x = h + 1
        with Tracer(): y = save(x + 1)
        z = y + 1
        return z

    print("result", f())
    """
)


@pytest.mark.slow  # starts a subprocess
@pytest.mark.native_only
@pytest.mark.parametrize("line", [6, 8])
def test_pdb_breakpoint_after_the_block_hits(tmp_path, line):
    script = tmp_path / "debugged.py"
    script.write_text(PDB_SCRIPT)
    commands = f"b {script}:{line}\nc\np ('at', h)\nc\nq\n"
    proc = subprocess.run(
        [sys.executable, "-m", "pdb", str(script)],
        input=commands, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    out = proc.stdout
    assert f"debugged.py({line})f()" in out, out
    assert "('at', 20)" in out, out
    assert "result 23" in out, out
