"""The benchmark harness runs end to end, so that it cannot rot: `python -m benchmarks` with 2
repetitions on the tiny shapes, every workload, and `--baseline HEAD` (this repository's last
commit exported and built as the "before" contender). Checked: every workload reports, every
contender that can do a case did it, and their results agree with plain hooks' (the harness
compares them before timing); the baseline ran from its own tree on its compiled extension,
and a baseline that cannot be had is one line while the run goes on. Timings are not
checked: on a shared machine they are noise. `--runs 2` has a cheap run of its own.
"""

import json
import os
import shutil
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


def _head():
    """This checkout's HEAD commit, or None (no git, or not a git checkout)."""
    git = shutil.which("git")
    if git is None:
        return None
    proc = subprocess.run([git, "-C", ROOT, "rev-parse", "--verify", "--quiet", "HEAD^{commit}"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _harness(*args, tmp):
    out = tmp / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--repeats", "2", "--shapes", "tiny", "--json", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    results, markdown, _ = _harness("--baseline", "HEAD", "--baseline-dir", str(tmp / "baseline"), tmp=tmp)
    return results, markdown


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
    assert {"raw", "hooks", "prototype", "interlace", "twin"} <= set(names)
    if _head():  # (without git the baseline is skipped with a line, checked just below)
        assert "baseline" in names, results["skipped"]
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
                for name in {"interlace", "twin", "baseline"} & set(results["contenders"]):
                    assert row[name]["agrees"], (wname, label, name)
    assert checked >= 20


def test_every_case_timed_for_the_interlace_paths(run):
    results, _ = run
    for wname, w in results["workloads"].items():
        for label, row in w.get("cases", {}).items():
            for name in {"interlace", "twin", w["floor"]} | {"baseline"} & set(results["contenders"]):
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
    assert {g["goal"] for g in results["goals"]} >= {"fixed", "save_one", "save_one_prototype", "sweep_item",
                                                     "edit_slope", "tracer", "import", "invokes",
                                                     "save_one_below", "zero_mlps_below", "sweep_item_below",
                                                     "edit_slope_below"}


def test_prototype_and_the_sweep_probe(run):
    """Issue 20's prototype contender does every workload its bodies cover, agreeing with plain
    hooks; the sweep probe reports us per item over the floor for every interlace path."""
    results, markdown = run
    w = results["workloads"]
    for wname in ("save_one", "zero_mlps", "save_all", "fixed", "invokes", "sweep_item"):
        for label, row in w[wname]["cases"].items():
            assert row["prototype"]["agrees"] is True, (wname, label)
    (label, row), = w["sweep_item"]["cases"].items()
    assert label == "tiny, 256 items" and row["hooks"]["rounds"] >= 2
    assert row["genproto"]["agrees"] is True  # the generator route's floor for sweeps
    per_item = w["sweep_item"]["per_item"]
    assert per_item["hooks"]["us"] > 0
    for name in {"prototype", "interlace", "twin", "baseline"} & set(results["contenders"]):
        assert per_item[name]["floor_us"] > 0 and "over_floor_us" in per_item[name], name
        assert f"- {results['labels'][name]}: " in markdown
    goals = {g["goal"]: g for g in results["goals"]}
    assert goals["sweep_item"]["interlace"] == row["interlace"]["overhead_us"]
    assert goals["save_one_prototype"]["interlace"] == pytest.approx(
        w["save_one"]["cases"]["tiny"]["interlace"]["overhead_us"]
        - w["save_one"]["cases"]["tiny"]["prototype"]["overhead_us"])


def test_baseline_is_the_commit_built_from_its_own_tree(run):
    """--baseline HEAD: the commit exported, built and measured in the same rounds as this tree,
    every workload with a before -> after line, the goals with a "before" figure."""
    head = _head()
    if head is None:
        pytest.skip("no git, or this checkout is not a git repository: --baseline needs one")
    results, markdown = run
    base = results["baseline"]
    assert "skipped" not in base, base
    # HEAD when the run started: this HEAD, or an ancestor if a commit landed meanwhile
    assert subprocess.run(["git", "-C", ROOT, "merge-base", "--is-ancestor", base["sha"], head]).returncode == 0
    assert os.path.isdir(os.path.join(base["tree"], "src", "interlace"))
    assert results["labels"]["baseline"] == base["label"] == f"interlace@HEAD {base['sha'][:7]} (native)"
    w = results["workloads"]
    for wname, entry in w.items():
        for row in entry.get("cases", {}).values():
            assert row["interlace"]["vs_baseline"] > 0, wname  # after / before, round by round
    assert set(results["before_after"]) >= {"save_one", "zero_mlps", "save_all", "edit_slope", "invokes",
                                            "fixed", "sweep_item", "wrapped", "tracer", "peak_memory", "cold_start",
                                            "import"}
    assert markdown.count(f"- before → after ({base['label']} → interlace): ") == len(results["before_after"])
    # before and after alike: each in a worker process of its own, neither in the harness's
    workers = results["workers"]
    assert {"baseline", "interlace", "twin"} <= set(workers) and len(set(workers.values())) == len(workers)
    assert os.getpid() not in workers.values()
    for wname, entry in w.items():
        for label, row in entry.get("cases", {}).items():
            for name in ("baseline", "interlace", "twin"):  # each against the floor of its own process
                assert row[name]["own_floor_us"] > 0, (wname, label, name)
    assert w["wrapped"]["structural"]["baseline"] == []  # its wrapper too leaves the module bare
    assert w["import"]["rows"]["baseline"]["wall_ms"] > 0 and w["cold_start"]["rows"]["baseline"]["first_ms"] > 0
    # (the per-edit goals need a steady slope; the checked floor's, a contender run only when named)
    assert all(g["baseline"] is not None for g in results["goals"]
               if not g["goal"].startswith("edit_slope") and g["goal"] != "save_one_checked")


def test_a_baseline_that_cannot_be_had_is_one_line_and_the_run_goes_on(tmp_path):
    results, markdown, stderr = _harness("--baseline", "no-such-ref-0123", "--baseline-dir", str(tmp_path / "b"),
                                         "--workloads", "fixed", "--contenders", "hooks,interlace", tmp=tmp_path)
    why = results["baseline"]["skipped"]
    assert why and "\n" not in why
    if _head():  # (without git, the line says git is missing instead)
        assert "no-such-ref-0123" in why
    assert f"skipped interlace@no-such-ref-0123 (native): {why}" in markdown
    assert [line for line in stderr.splitlines() if "no-such-ref-0123" in line] == [
        f"[bench] skipping interlace@no-such-ref-0123 (native): {why}"]
    assert results["contenders"] == ["hooks", "interlace"]
    assert results["workloads"]["fixed"]["cases"]["linear"]["interlace"]["agrees"]
    assert not os.path.exists(tmp_path / "b")  # nothing exported for a ref that does not resolve


def _bench_module(name):
    """benchmarks/<name>.py on its own (importing the package would put src/ on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (a dataclass looks its module up while being made)
    spec.loader.exec_module(module)
    return module


def _baseline_module():
    return _bench_module("baseline")


def test_several_runs_report_the_median_and_the_spread_of_fresh_runs(tmp_path):
    """--runs 2: two whole measurements, fresh workers each; the figures are the median (of
    two: the mean) of the per-run figures, with their min-max beside them in the table."""
    results, markdown, _ = _harness("--runs", "2", "--workloads", "fixed,tracer", "--contenders",
                                    "raw,hooks,interlace,twin", tmp=tmp_path)
    each = results["runs"]
    assert len(each) == 2 and results["settings"]["runs"] == 2
    assert each[0]["workers"]["twin"] != each[1]["workers"]["twin"]  # a fresh worker per run
    assert "median of 2 whole runs" in markdown
    for wname, label in (("fixed", "linear"), ("tracer", "tiny body")):
        for name in ("interlace", "twin"):
            per_run = [r["workloads"][wname]["cases"][label][name]["ratio"] for r in each]
            cell = results["workloads"][wname]["cases"][label][name]
            assert cell["ratio"] == pytest.approx((per_run[0] + per_run[1]) / 2)
            assert cell["ratio_spread"] == [min(per_run), max(per_run)]
            assert f"x, {min(per_run):.2f}-{max(per_run):.2f})" in markdown
            if wname == "fixed":  # (a do-nothing body has no result to compare)
                assert cell["agrees"] is True
    goal = next(g for g in results["goals"] if g["goal"] == "tracer")
    assert goal["interlace"] == results["workloads"]["tracer"]["cases"]["tiny body"]["interlace"]["ratio"]

    # --combine: the same two runs, each from its own file (as a time-limited GPU lease runs
    # them, one process each), read as one: the same figures and the same report
    files = []
    for i, one in enumerate(each):
        files.append(tmp_path / f"run{i}.json")
        files[-1].write_text(json.dumps(one))
    again, remarkdown, _ = _harness("--combine", *map(str, files), tmp=tmp_path)
    assert again["settings"] == results["settings"] and again["runs"] == each
    assert again["workloads"] == results["workloads"] and again["goals"] == results["goals"]
    assert "median of 2 whole runs" in remarkdown


def test_combine_refuses_what_it_cannot_read_as_one_result(tmp_path):
    """--combine reads single runs of one measurement: a file it cannot read, a file that
    already combines runs, or runs measured with other settings are each one line, not a
    report."""
    def run_file(name, **settings):
        path = tmp_path / name
        path.write_text(json.dumps({"settings": {"device": "cpu", "repeats": 2, "runs": 1, **settings}}))
        return str(path)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    combined = tmp_path / "combined.json"
    combined.write_text(json.dumps({"settings": {"runs": 2}, "runs": [{}, {}]}))
    cases = {
        "cannot read": [run_file("a.json"), str(tmp_path / "missing.json")],
        "already combines 2 runs": [str(combined)],
        "other settings": [run_file("a.json"), run_file("b.json", repeats=200)],
    }
    for says, files in cases.items():
        proc = subprocess.run([sys.executable, "-m", "benchmarks", "--combine", *files], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and proc.stdout == "", (says, proc.stdout[-500:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("--combine: ") and says in lines[0], (says, proc.stderr)


def test_combining_runs_by_hand():
    combine = _bench_module("runs").combine
    runs = [{"settings": {"runs": 3}, "w": {"c": {"ratio": r, "agrees": ok, "max_diff": d, "label": f"run{i}"}}}
            for i, (r, ok, d) in enumerate([(1.30, True, 0.0), (1.10, False, 2e-5), (1.20, True, 1e-6)])]
    got = combine(runs)
    assert got["settings"] == {"runs": 3}
    assert got["w"]["c"] == {"ratio": 1.20, "ratio_spread": [1.10, 1.30], "agrees": False, "max_diff": 2e-5,
                             "label": "run0"}


def test_a_body_looks_its_modules_up_as_the_helpers_do():
    """The interlace and nnsight bodies look their modules up with `layers_of`/`head_of` (one
    C call, as a user's inline attribute chain): the same modules, or Envoys of them, as the
    `layers`/`lm_head` helpers give."""
    subjects = _bench_module("subjects")
    s = subjects.build("tiny")
    assert s.layers_of(s.module) is s.layers() and s.head_of(s.module) is s.lm_head()
    assert s.layers() is s.module.transformer.h and s.lm_head() is s.module.lm_head  # as written by hand
    model = interlace.Model(s.module)
    assert s.layers_of(model)[0]._module is s.layers()[0]
    assert s.head_of(model)._module is s.lm_head()
    assert subjects.build("linear").layers_of is None  # a 2x2 Linear has no layers


def test_a_worker_that_dies_says_why_in_one_line(tmp_path, capfd):
    """A worker whose interlace cannot even be imported (as a baseline from the middle of a
    redesign may be) reports its last error line, not "see above"."""
    broken = tmp_path / "src" / "interlace"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import os, sys\nprint('ImportError: half-done tree', file=sys.stderr)\n"
                                        "sys.stderr.flush()\nos._exit(3)\n")
    saved = list(sys.path)
    try:
        sys.path.insert(0, ROOT)
        from benchmarks import measure
    finally:
        sys.path[:] = saved
    with pytest.raises(RuntimeError) as caught:
        measure.Worker({"device": "cpu", "dtype": "float32", "threads": 1}, src=str(tmp_path / "src"))
    assert str(caught.value) == "the worker process exited (status 3): ImportError: half-done tree"
    assert "ImportError: half-done tree" in capfd.readouterr().err  # passed through as it came


def test_baseline_without_git_says_so(tmp_path):
    why = _baseline_module().prepare("HEAD", ROOT, str(tmp_path), git=str(tmp_path / "no-git-here"))
    assert why == "git is not available on this machine"


def test_baseline_build_failure_says_so_and_the_export_is_reused(tmp_path):
    head = _head()
    if head is None:
        pytest.skip("no git, or this checkout is not a git repository: --baseline needs one")
    baseline = _baseline_module()
    failing = shutil.which("false")
    if failing is None:
        pytest.skip("no `false` command to stand in for a failing build")
    why = baseline.prepare(head, ROOT, str(tmp_path), python=failing)
    tree = tmp_path / f"baseline-{head[:12]}"
    assert why == f"building {head}'s extension in {tree} failed: exit status 1"
    marker = tree / baseline.MARKER
    assert marker.read_text().strip() == head and (tree / "setup.py").exists()
    before = marker.stat().st_mtime_ns
    assert baseline.prepare(head, ROOT, str(tmp_path), python=failing) == why
    assert marker.stat().st_mtime_ns == before  # exported once, reused


def test_every_probe_is_listed_and_compiles():
    """benchmarks/probes/ holds the scripts outside the harness, each with its line in
    benchmarks/README.md saying what it isolates; no stray bench_*.py is left beside the harness."""
    import glob

    probes = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "probes", "*.py")))
    assert probes and not glob.glob(os.path.join(ROOT, "benchmarks", "bench_*.py"))
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Probes"):]
    for path in probes:
        assert f"- `{os.path.basename(path)}`: " in section, path
        with open(path) as f:
            compile(f.read(), path, "exec")


def test_every_step_the_steps_probe_wraps_exists():
    """`probes/steps.py` wraps interlace's functions by name (STEPS); one renamed or moved to
    the compiled extension must leave the list, or the probe stops at its first trace."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))
    try:
        steps = importlib.import_module("steps")
    finally:
        sys.path.pop(0)
    for module_name, path in steps.STEPS:
        owner = importlib.import_module(module_name)
        for part in path.split("."):
            assert hasattr(owner, part), (module_name, path)
            owner = getattr(owner, part)


def test_every_contender_the_trace_instructions_probe_counts_exists_with_its_workloads():
    """`probes/trace_instructions.py` names its contenders by module and class, and shifts
    the layout before any import: each must be a harness contender with the workloads the
    probe's help names, and a layout must be a different number of kept objects."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))
    try:
        probe = importlib.import_module("trace_instructions")
    finally:
        sys.path.pop(0)
    for name, (module_name, class_name) in probe.CONTENDERS.items():
        cls = getattr(importlib.import_module(module_name), class_name)
        assert all(callable(getattr(cls, work, None)) for work in ("save_one", "zero_mlps", "fixed")), name
    assert probe.shift_layout(0) == [] and len(probe.shift_layout(2)) > len(probe.shift_layout(1)) > 0
    # the type cache's misses are priced as find_name_in_mro's inclusive cost, its own file's
    # entry and the inlined parts alike; other functions (a caller, a prefix) are not counted
    annotated = (
        "226,362,165 (100.0%)  PROGRAM TOTALS\n"
        "  2,592,761 ( 1.15%)  /b/Python-3.11.7/Objects/typeobject.c:find_name_in_mro [/lib/libpython3.11.so]\n"
        "     49,941 ( 0.02%)  /b/Python-3.11.7/./Include/object.h:find_name_in_mro\n"
        "  4,309,444 ( 1.90%)  /b/Python-3.11.7/Objects/typeobject.c:_PyType_Lookup [/lib/libpython3.11.so]\n"
        "        900 ( 0.00%)  /b/x.c:not_find_name_in_mro_at_all [/lib/x.so]\n"
    )
    assert probe.mro_walks(annotated) == 2_592_761 + 49_941
    assert probe.mro_walks("") == 0


def test_steps_probe_reads_cache_misses_from_the_dumps(tmp_path, capsys):
    """`steps.py --cache` sums callgrind's simulated misses per dump: L1 (instruction, data read
    and write) and L2 (the same beyond L2); without the simulation the misses are 0. Fake dumps,
    as callgrind writes them, stand in for a valgrind run (minutes)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))
    try:
        import steps
    finally:
        sys.path.pop(0)
    (tmp_path / "cg.out.2").write_text(
        "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 1 2 3 4 5 6 7 8 9\n"
        "totals: 100 20 30 1 2 3 4 5 6\n")
    (tmp_path / "cg.out.10").write_text("events: Ir\ntotals: 70\n")
    (tmp_path / "other.txt").write_text("totals: 5\n")
    assert steps.dumps(str(tmp_path)) == [(100, 6, 15), (70, 0, 0)]  # in dump order: 2, 10
    assert steps.cache_options()[0] == "--cache-sim=yes"
    # --footprint: whole calls only (no step log); the table gives each one's lines over raw
    for i, (instructions, lines) in enumerate(((500, 1000), (520, 1100), (700, 1400)), 1):
        (tmp_path / f"cg.out.{i}").write_text(f"events: Ir DLmr\ntotals: {instructions * 2} {lines * 2}\n")
    for name in ("cg.out.10", "cg.out.2.x"):
        (tmp_path / name).unlink(missing_ok=True)
    (tmp_path / "log.json").write_text(json.dumps(
        {"log": [], "totals": ["raw forward", "prototype", "trace, whole"], "traces": 2}))
    steps.table(str(tmp_path), cache=True)
    shown = capsys.readouterr().out
    assert "| prototype | 1,100 | +100 | 520 |" in shown and "| trace, whole | 1,400 | +400 | 700 |" in shown
    assert [o.split("=")[0] for o in steps.cache_options()[1:]] == ["--D1", "--I1", "--LL"]


def test_lines_probe_splits_two_dumps_lines_by_library_and_function():
    """`lines.py` reads `callgrind_annotate --show=ILmr,DLmr,DLmw` rows (a count may be "."
    for none, with or without its percentage) and gives B minus A per call: code lines
    (ILmr) and data lines (DLmr + DLmw), per library and per function. Annotated text as
    valgrind 3.19 prints it stands in for a dump."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))
    try:
        import lines
    finally:
        sys.path.pop(0)
    header = ("-" * 80 + "\nILmr DLmr DLmw  file:function\n" + "-" * 80 + "\n")
    before = lines.parse(header + (
        "30 (50.0%)  20 (40.0%)  .  PROGRAM TOTALS\n"
        "20 (40.0%)  10 (20.0%)  4 (8.0%)  /src/ceval.c:_PyEval_EvalFrameDefault [/lib/libpython3.11.so.1.0]\n"
        "10 (10.0%)  .           .          ???:at::native::slice(at::Tensor const&) [/lib/libtorch_cpu.so]\n"))
    after = lines.parse(header + (
        "1,020 (50.0%)  40 (40.0%)  .  /src/ceval.c:_PyEval_EvalFrameDefault [/lib/libpython3.11.so.1.0]\n"
        "  100          .           20  /work/csrc/_chotpath.c:__pyx_f_run [/work/src/interlace/_chotpath.so]\n"
        "    6 (0.1%)   2 (0.1%)    .   object.h:__pyx_f_inlined\n"))
    assert before[("libpython3.11.so.1.0", "ceval.c:_PyEval_EvalFrameDefault")] == [20, 14]
    assert ("libpython3.11.so.1.0", "PROGRAM TOTALS") not in before and len(before) == 2
    assert after[("_chotpath.so", "_chotpath.c:__pyx_f_run")] == [100, 20]
    assert after[("?", "object.h:__pyx_f_inlined")] == [6, 2]
    by_library, functions = lines.compare(before, after, calls=2)
    assert by_library[0] == ("libpython3.11.so.1.0", [500.0, 13.0])  # (1,020 - 20) / 2, (40 - 14) / 2
    assert dict(by_library)["libtorch_cpu.so"] == [-5.0, 0.0]
    assert dict(by_library)["_chotpath.so"] == [50.0, 10.0]
    assert functions[0][2] == ("libpython3.11.so.1.0", "ceval.c:_PyEval_EvalFrameDefault")


def test_steps_probe_walks_the_invokes_steps_of_a_trace_of_invokes(tmp_path):
    """`steps.py --invokes N` counts a trace of N invokes: its inside run, here without
    callgrind (its marks are no-ops outside valgrind) and in a process of its own (it wraps
    interlace's functions for good), logs each invoke's collection and the batching of
    their prompts, once per invoke and once per trace."""
    probe = os.path.join(ROOT, "benchmarks", "probes", "steps.py")
    sys.path.insert(0, os.path.dirname(probe))
    try:
        import steps
    finally:
        sys.path.pop(0)
    library, why = steps.build_helper(str(tmp_path))
    if library is None:
        pytest.skip(f"steps.py's marks helper: {why}")
    done = subprocess.run([sys.executable, probe, "--inside", str(tmp_path), "--traces", "2",
                           "--invokes", "3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = {}
    for name, kind, _ in json.loads((tmp_path / "log.json").read_text())["log"]:
        calls[name] = calls.get(name, 0) + (kind == 1)
    assert calls["_InvokeBackend.__call__"] == 2 * 3 and calls["GeneratorMediator.start"] == 2 * 3
    assert calls["PromptBatcher.batch_invokes"] == 2 and calls["trace, whole"] == 2
    assert "Express.run" not in calls  # several invokes: the general run


def test_routes_probe_times_both_routes_of_the_same_sites(tmp_path):
    """`probes/routes.py`: the same warm sites timed as generators and on greenlets, in paired
    rounds; each case reports both medians, and the sites run as generators again after."""
    env = dict(os.environ)
    env.pop("INTERLACE_GENERATORS", None)  # (the probe turns the route on itself)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "probes", "routes.py"),
                           "--rounds", "3", "--sweep-rounds", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["linear", "tiny", "sweep per item"]
    for row in rows[1:]:
        generator, greenlet = (float(cell.strip().replace(",", "")) for cell in row.split("|")[2:4])
        assert generator > 0 and greenlet > 0


def test_device_calls_probe_lists_what_differs_from_the_raw_forward():
    """`probes/device_calls.py`: per workload, the events whose count per call differs from
    the raw forward's; saving one block asks for nothing more (an empty table)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "probes", "device_calls.py"),
                           "--workloads", "save_one,zero_mlps", "--calls", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    save_one, zero_mlps = out.split("### save_one")[1].split("### zero_mlps")
    assert "| (none) | | | |" in save_one
    assert "| `aten::zeros_like` | 0 | 2 | 2 |" in zero_mlps  # one per MLP, hooks and trace alike


def test_issue_21_goals_read_the_worst_run_and_refuse_an_unsteady_slope():
    """Issue 21's save-one goal must hold in each run (its worst run is read), and its per-edit
    goal is read only when plain hooks' own slope stays within ±25% of its median."""
    report = _bench_module("report")

    def results(hooks_spread):
        return {"contenders": ["hooks", "interlace"], "workloads": {
            "save_one": {"cases": {"tiny": {"interlace": {"ratio": 0.97, "ratio_spread": [0.96, 0.99]}}}},
            "edit_slope": {"summary": {
                "hooks": {"per_edit_us": 10.0, "per_edit_us_spread": hooks_spread, "ratio": 1.0},
                "interlace": {"per_edit_us": 12.0, "ratio": 1.2}}}}}

    steady = {g["goal"]: g for g in report.goals(results([8.0, 12.0]))}
    assert steady["save_one_below"]["interlace"] == 0.99 and steady["save_one_below"]["met"] is False
    assert steady["edit_slope_below"]["met"] is True and "unreadable" not in steady["edit_slope_below"]
    unsteady = {g["goal"]: g for g in report.goals(results([-3.0, 20.0]))}
    assert unsteady["edit_slope_below"]["met"] is None
    assert "-3.0 to 20.0" in unsteady["edit_slope_below"]["unreadable"]
    assert unsteady["edit_slope"]["met"] is True  # issue 8's goal has no such rule


def test_the_checked_floor_runs_only_when_named_and_agrees_with_plain_hooks(run, tmp_path):
    """The `checked` contender (the express run's mechanism with its checks, written plainly)
    saves and edits what plain hooks do; a default run leaves it out (its lines would raise
    every other contender's figures), and the goals read interlace against it when it ran."""
    results, _ = run
    assert "checked" not in results["contenders"]
    named, markdown, _ = _harness("--contenders", "hooks,checked,interlace", "--workloads",
                                  "save_one,zero_mlps,fixed", "--shapes", "tiny,linear", tmp=tmp_path)
    w = named["workloads"]
    for wname, label in (("save_one", "tiny"), ("zero_mlps", "tiny"), ("fixed", "linear")):
        assert w[wname]["cases"][label]["checked"]["agrees"] is True, wname
    goal = next(g for g in named["goals"] if g["goal"] == "save_one_checked")
    row = w["save_one"]["cases"]["tiny"]
    assert goal["interlace"] == pytest.approx(row["interlace"]["overhead_us"] - row["checked"]["overhead_us"])
    assert "tracer core + checked generator engine (prototype)" in markdown
