"""`import interlace` stays cheap: what it loads is only what the tracer core needs to exist.

The heavy modules (logging, typing, the `bytecode` library, ctypes, torch, transformers) load
on the first trace or first use, not at import. The check compares a fresh interpreter's
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

PROBE = ("import sys; before = set(sys.modules); {code}; "
         "print(__import__('json').dumps(sorted(set(sys.modules) - before)))")


def loaded_by(code: str) -> set:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True,
                          text=True, timeout=120, env=env, check=True)
    return set(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.parametrize("code", ["import interlace", "from interlace import Tracer, save"])
def test_import_loads_no_heavy_module(code):
    loaded = loaded_by(code)
    assert "interlace.tracing.tracer" in loaded  # the probe really imported the core
    heavy = sorted(name for name in loaded if name.split(".")[0] in LAZY)
    assert not heavy, f"`{code}` loads {heavy}: import them where they are first needed"


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
    assert "interlace.tracing.blocks" in loaded_by(code)
