"""coverage.py records exactly the lines the same program records with its blocks inline.

Runs coverage in a subprocess (COVERAGE_CORE selects ctrace, pytrace or sysmon) on a small
program whose `with` blocks are either traces or a do-nothing context manager, and compares
the executed-line sets: no line lost after a block, none invented. Native path only (the
twin's trace function on 3.10/3.11 loses the rest of the frame, as nnsight's does).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

coverage = pytest.importorskip("coverage")

PROGRAM = textwrap.dedent(
    """\
    import sys
    from interlace import Tracer, save as _save
    from inline_cm import Inline, keep

    T = Tracer if sys.argv[1] == "trace" else Inline
    save = _save if T is Tracer else keep

    def loop(n):
        total = 0
        for i in range(n):
            with T():
                h = save(i + 1)
            total += h
        after = total * 2
        return after

    def pair():
        with T() as t:
            a = save(1)
            b = save(2)
        c = a + b
        if c > 10:
            c = 0
        return c

    def same_line():
        with T(): x = save(3)
        return x

    def try_first(fail):
        with T():
            try:
                if fail:
                    raise ValueError("no")
                y = save(4)
            except ValueError:
                y = save(5)
        return y

    def helper_after():
        return "helper"

    def calls_after():
        with T():
            z = save(6)
        return helper_after() + str(z)

    class Body:
        with T():
            k = save(7)
        j = k + 1

    with T():
        m = save(8)
    print(loop(3), pair(), same_line(), try_first(False), try_first(True), calls_after(), Body.j, m)
    """
)

INLINE_CM = textwrap.dedent(
    """\
    class Inline:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def keep(value):
        return value
    """
)

RUNNER = textwrap.dedent(
    """\
    import json, runpy, sys
    import coverage
    script, mode = sys.argv[1], sys.argv[2]
    cov = coverage.Coverage(data_file=None, include=[script])
    cov.start()
    sys.argv = [script, mode]
    runpy.run_path(script, run_name="__main__")
    cov.stop()
    print("LINES", json.dumps(sorted(cov.get_data().lines(script))))
    """
)


def cores():
    out = ["ctrace", "pytrace"]
    if sys.version_info >= (3, 12):
        out.append("sysmon")
    return out


def run(tmp_path, mode, core):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    (tmp_path / "inline_cm.py").write_text(INLINE_CM)
    env = {**os.environ, "COVERAGE_CORE": core, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, str(runner), str(script), mode],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    printed, lines = proc.stdout.split("LINES ")
    return printed.strip(), json.loads(lines)


@pytest.mark.slow  # starts a subprocess
@pytest.mark.native_only
@pytest.mark.parametrize("core", cores())
def test_coverage_sees_the_same_lines_as_inline(tmp_path, core):
    inline_out, inline_lines = run(tmp_path, "inline", core)
    traced_out, traced_lines = run(tmp_path, "trace", core)
    assert traced_out == inline_out == "12 3 3 4 5 helper6 8 8"
    assert set(traced_lines) ^ set(inline_lines) == set()
