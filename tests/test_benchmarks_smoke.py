"""The benchmark harness runs end to end, so that it cannot rot: `python -m benchmarks` with 2
repetitions on the tiny shapes, every workload. Checked: every workload reports, every
contender that can do a case did it, and their results agree with plain hooks' (the harness
compares them before timing). Timings are not checked: on a shared machine they are noise.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers", reason="the harness's subjects need a tokenizer (pip install tokenizers)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import interlace  # noqa: E402

# The harness measures the compiled path in its own process and the twin in a worker process
# it starts itself: one run covers both, so the suite's twin pass does not run it again.
pytestmark = [
    pytest.mark.skipif(not interlace.native, reason="the harness runs the twin itself (a worker "
                       "process); the compiled path's run of this test covers both"),
    pytest.mark.slow, pytest.mark.torch,
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--repeats", "2", "--shapes", "tiny", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_workload_reports(run):
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.workloads import WORKLOADS
    finally:
        sys.path.remove(ROOT)
    results, markdown = run
    assert set(results["workloads"]) == set(WORKLOADS)
    assert results["hardware"]["line"] in markdown and "### Goals" in markdown
    for w in results["workloads"].values():
        assert w["title"] in markdown


def test_contenders_present_or_skipped_with_a_reason(run):
    results, markdown = run
    names = results["contenders"]
    assert {"raw", "hooks", "interlace", "twin"} <= set(names)
    for label, why in results["skipped"].items():
        assert f"skipped {label}: {why}" in markdown
    labels = {results["labels"][n] for n in names} | set(results["skipped"])
    assert {"nnsight", "TransformerLens"} <= labels  # measured, or skipped with a line


def test_results_agree_with_plain_hooks(run):
    results, _ = run
    checked = 0
    for wname, w in results["workloads"].items():
        for label, row in w.get("cases", {}).items():
            for name, cell in row.items():
                assert "error" not in cell, f"{wname} / {label}: {name} failed: {cell['error']}"
                assert cell.get("agrees") is not False, (
                    f"{wname} / {label}: {name}'s results differ from {w['floor']}'s "
                    f"(max abs difference {cell.get('max_diff')})")
                checked += cell.get("agrees") is True
            if wname != "tracer":  # a do-nothing body has no result to compare
                assert row["interlace"]["agrees"] and row["twin"]["agrees"], (wname, label)
    assert checked >= 20


def test_every_case_timed_for_the_interlace_paths(run):
    results, _ = run
    for wname, w in results["workloads"].items():
        for label, row in w.get("cases", {}).items():
            for name in ("interlace", "twin", w["floor"]):
                assert row[name]["rounds"] == row[w["floor"]]["rounds"] >= 2, (wname, label, name)
                assert row[name]["median_us"] > 0


def test_structure_memory_and_fresh_processes(run):
    results, _ = run
    w = results["workloads"]
    assert w["wrapped"]["structural"]["interlace"] == []  # no hooks, the module's own forward
    if "nnsight" in results["contenders"]:
        assert w["wrapped"]["structural"]["nnsight"]  # nnsight replaces forwards: the check sees it
    peak = w["peak_memory"]["peak_bytes"]
    assert None not in peak.values(), peak  # a contender failed: see the harness's stderr
    logits = 16 * 1000 * 4  # tiny: 16 tokens x vocab 1000 floats, alive at the end of every run
    assert all(peak[name] >= peak["raw"] >= logits for name in ("hooks", "interlace", "twin"))
    for name in ("interlace", "twin"):
        assert w["cold_start"]["rows"][name]["first_ms"] > 0
        assert w["import"]["rows"][name]["wall_ms"] > 0
    assert {g["goal"] for g in results["goals"]} >= {"fixed", "save_one", "edit_slope", "tracer", "import", "invokes"}
