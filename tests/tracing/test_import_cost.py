"""`import interlace` stays cheap: what it loads is only what the tracer core needs to exist.

The heavy modules (logging, typing, the `bytecode` library, ctypes, torch, transformers, and
the parser: ast, dis, re, with dataclasses and inspect, which import them) load on the first
trace or first use, not at import: the goal is `import interlace` within 30 ms of an empty
interpreter (8-10 ms measured on 3.10-3.13, down from 22 ms; docs/architecture.md says how). The check compares a fresh interpreter's
modules after `import interlace` with those of an empty one, so whatever `site` loads does
not count. How long the import takes is measured by `python -m benchmarks` (import workload),
not asserted here: timings on a shared machine are noise.
"""

import json
import os
import subprocess
import sys

import pytest

#: Modules `import interlace` must not load (each is loaded where it is first needed).
LAZY = ("logging", "typing", "bytecode", "ctypes", "torch", "transformers")
#: The parser and what imports it: loaded by `interlace.tracing.syntax` at the first capture.
PARSER = ("ast", "dis", "re", "dataclasses", "inspect", "tokenize", "linecache")

# (the difference is taken before `json` is imported: json imports re)
PROBE = ("import sys; before = set(sys.modules); {code}; loaded = sorted(set(sys.modules) - before); "
         "import json; print(json.dumps(loaded))")


def loaded_by(code: str) -> set:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True,
                          text=True, timeout=120, env=env, check=True)
    return set(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.slow  # starts a subprocess
@pytest.mark.parametrize("code", ["import interlace", "from interlace import Tracer, save"])
def test_import_loads_no_heavy_module(code):
    loaded = loaded_by(code)
    assert "interlace.tracing.tracer" in loaded  # the probe really imported the core
    heavy = sorted(name for name in loaded if name.split(".")[0] in LAZY)
    assert not heavy, f"`{code}` loads {heavy}: import them where they are first needed"


@pytest.mark.slow  # starts a subprocess
@pytest.mark.parametrize("code", ["import interlace", "from interlace import Tracer, save"])
def test_import_loads_no_parser(code):
    loaded = loaded_by(code)
    assert "interlace.tracing.tracer" in loaded
    parser = sorted(name for name in loaded if name.split(".")[0] in PARSER)
    assert not parser, f"`{code}` loads {parser}: the capture machinery (tracing/syntax.py) loads them"


@pytest.mark.slow  # starts a subprocess
def test_first_trace_still_works_after_a_cheap_import(tmp_path):
    """The lazy modules load on demand: a fresh interpreter traces a block right away."""
    (tmp_path / "first_trace.py").write_text(
        "import interlace\n"
        "def f():\n"
        "    with interlace.Tracer():\n"
        "        x = interlace.save([1, 2])\n"
        "    return x\n"
        "assert f() == [1, 2]\n"
    )
    code = f"sys.path.insert(0, {str(tmp_path)!r}); import first_trace"
    loaded = loaded_by(code)
    assert "interlace.tracing.syntax" in loaded
    assert "ast" in loaded
