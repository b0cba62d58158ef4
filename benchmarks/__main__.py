"""python -m benchmarks: every workload, every contender, in one run; a markdown report and JSON.

    python -m benchmarks                          # CPU, default shapes, 100 rounds a case
    python -m benchmarks --device cuda            # the same on a GPU (bf16, synchronised timing)
    python -m benchmarks --repeats 2 --shapes tiny --json out.json   # the smoke test's run
    python -m benchmarks --workloads save_one,edit_slope --contenders hooks,interlace
    python -m benchmarks --baseline 2eafd86       # before/after: interlace at 2eafd86, built, beside this tree's
    python -m benchmarks --runs 3 --baseline 2eafd86   # the same three times: medians and spread
    python -m benchmarks --combine r1.json r2.json r3.json   # separate runs' JSON read as one --runs 3

Contenders (benchmarks/contenders.py): raw forward, plain hooks (the floor), issue 20's
tapped-greenlet prototype (benchmarks/prototype.py), interlace native, the interlace twin (a worker process, taking turns with this one), with --baseline
interlace as it was at that git ref (benchmarks/baseline.py; another worker process), nnsight
0.8.1 and TransformerLens when installed (`pip install -e '.[bench]'`); a missing one is
skipped with a line saying so. With a baseline, this tree's interlace runs in a worker too, so
before and after are measured alike; every worker's contender is compared with the floor
timed in its own process. --runs N repeats everything with fresh workers and reports the
medians with their spread (benchmarks/runs.py). Workloads: benchmarks/workloads.py. The report goes to stdout,
the figures to --json (default build/bench-<device>.json); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from . import baseline as B
from . import contenders as C
from . import measure, report, runs, subjects, workloads
from .prototype import GeneratorChecked, GeneratorCore, GeneratorPrototype, Prototype


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (CUDA default), ...")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU default 1: least noise)")
    p.add_argument("--repeats", type=int, default=100, help="timed rounds per case (costly workloads run fewer)")
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(subjects.SHAPES)}")
    p.add_argument("--workloads", default=None, help=f"comma-separated, of {', '.join(workloads.WORKLOADS)}")
    p.add_argument("--contenders", default=None,
                   help="comma-separated, of raw, hooks, prototype, genproto, gencore, checked (only when named), interlace, "
                        "twin, baseline, nnsight, tlens")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="also measure interlace as it was at this git ref (built in place): before/after in one run")
    p.add_argument("--baseline-dir", default=None, metavar="DIR",
                   help="where REF's tree is exported and built (default: build/, reused across runs)")
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="the whole measurement N times, fresh workers each time: medians of the per-run "
                        "figures, with their spread (min-max)")
    p.add_argument("--json", default=None, help="where to write the figures")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="measure nothing: read these runs' --json files (one run each, e.g. each under its own "
                        "time limit) and report them as one --runs N result")
    o = p.parse_args(argv)
    if o.runs < 1:
        p.error(f"--runs {o.runs}: at least 1")
    device = "cuda" if o.device.startswith("cuda") else "cpu"
    o.dtype = o.dtype or ("bfloat16" if device == "cuda" else "float32")
    o.threads = o.threads if o.threads is not None else (1 if device == "cpu" else 0)
    o.shapes = o.shapes.split(",") if o.shapes else list(subjects.DEFAULT_SHAPES[device])
    o.workloads = o.workloads.split(",") if o.workloads else list(workloads.WORKLOADS)
    for name in o.shapes:
        if name not in subjects.SHAPES:
            p.error(f"unknown shape {name!r}; known: {', '.join(subjects.SHAPES)}")
    for name in o.workloads:
        if name not in workloads.WORKLOADS:
            p.error(f"unknown workload {name!r}; known: {', '.join(workloads.WORKLOADS)}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device {o.device}: torch {torch.__version__} sees no CUDA device here")
    o.json_given = o.json is not None  # --combine writes only where asked
    o.json = o.json or os.path.join(measure.ROOT, "build", f"bench-{device}.json")
    o.baseline_dir = o.baseline_dir or os.path.join(measure.ROOT, "build")
    return o


def hardware(o) -> dict:
    import torch
    import transformers

    import interlace

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if o.device.startswith("cuda") else None
    threads = torch.get_num_threads()
    line = (f"{gpu + ' (' + o.dtype + '), ' if gpu else ''}CPU {cpu} ({os.cpu_count()} cores), "
            f"{threads} torch thread{'s' if threads != 1 else ''}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, Python {platform.python_version()}, "
            f"interlace {interlace.__version__} ({'compiled extension' if interlace.native else 'twin only'})")
    return {"line": line, "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch_threads": threads,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "interlace_native": interlace.native,
            "date": time.strftime("%Y-%m-%d")}


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def timed(w, cases, active, settings, o) -> dict:
    """A timed workload: each case's contenders checked against the floor, then timed together.

    A contender in a worker process (the twin, the baseline, this tree's interlace beside a
    baseline) is compared with the floor and the raw forward timed in its own process, in the
    same rounds (`own_floor_us`), never with this process's: see measure's docstring."""
    rounds = max(2, round(o.repeats * w.rounds))
    warmup = max(1, rounds // 10)
    out = {"title": w.title, "goal": w.goal, "floor": cases[0].floor if cases else "hooks", "cases": {}}
    for case in cases:
        progress(f"{w.name}: {case.label} ({rounds} rounds)")
        runners, results, failed, remote = {}, {}, {}, []
        for c in active:
            try:
                r = measure.runner(c, case.op, case.shape, case.args, settings)
                if r is None:
                    continue
                result = r.result()
                own = {}
                if isinstance(c, measure.RemoteContender):  # its floor, timed in its own process
                    for who in dict.fromkeys((case.floor, "raw")):
                        mine = c.runner(case.op, case.shape, case.args, who=who)
                        if mine is not None:
                            own[f"{c.name}/{who}"] = mine
            except Exception as error:  # noqa: BLE001 - one contender failing a case is reported, not fatal
                failed[c.name] = {"error": f"{type(error).__name__}: {error}".strip().splitlines()[-1]}
                progress(f"  {c.label} failed: {failed[c.name]['error'][:300]}")
                continue
            runners[c.name] = r
            runners.update(own)
            if own:
                remote.append(c.name)
            if c.name != "raw" or case.floor == "raw":
                results[c.name] = result
            del result
        checks = measure.agree(results, case.floor, loose=frozenset({"tlens"}))
        del results
        times = measure.interleaved(runners, rounds, warmup)
        here = {name: ts for name, ts in times.items() if name not in remote and "/" not in name}
        rows = measure.summarize(here, case.floor, case.per_call)
        for name in remote:
            floor, raw = times.get(f"{name}/{case.floor}"), times.get(f"{name}/raw")
            mine = {name: times[name], **({"floor": floor} if floor else {})}
            rows[name] = {**measure.summarize(mine, "floor", case.per_call)[name], "own_floor_us":
                          statistics.median(floor) / 1e3 / case.per_call if floor else None}
            if raw and case.floor != "raw":
                above = measure.summarize({name: times[name], "floor": floor or raw, "raw": raw}, "raw",
                                          case.per_call)
                rows[name]["over_raw_us"] = above[name]["overhead_us"]
                rows[name]["own_floor_over_raw_us"] = above["floor"]["overhead_us"]
        for name, (ok, diff) in checks.items():
            rows[name].update(agrees=ok, max_diff=diff)
        if "raw" in here and case.floor != "raw":  # above the bare forward of the same round
            for name, row in measure.summarize(here, "raw", case.per_call).items():
                rows[name]["over_raw_us"] = row["overhead_us"]
        if "baseline" in times and "interlace" in times:
            # after / before, round by round: both ran in every round, so a burst of load hits
            # both; beside a baseline both run in worker processes of the same kind
            rows["interlace"]["vs_baseline"] = measure.summarize(
                {"a": times["interlace"], "b": times["baseline"]}, "b")["a"]["ratio"]
        out["cases"][case.label] = {**rows, **failed}
    return out


def peak(w, cases, active, settings) -> dict:
    case = cases[0]
    progress(f"{w.name}: {case.label}")
    values = {}
    for c in active:
        try:
            r = measure.runner(c, case.op, case.shape, case.args, settings)
            if r is None:
                continue
            r.result()  # warm: first-call allocations are not what a trace needs
            values[c.name] = r.peak()
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            values[c.name] = None
            progress(f"  {c.label} failed: {type(error).__name__}: {str(error)[:300]}")
    base = values.get("raw") or 0
    return {"title": w.title, "goal": w.goal, "case": case.label, "peak_bytes": values,
            "peak": {n: None if v is None else v - base for n, v in values.items()}}


def native_worker(settings, src, label, name):
    """(contender, None) for a worker running the interlace at `src` on its compiled
    extension, or (an unavailable contender, why) when it cannot start or loads another one."""
    try:
        worker = measure.Worker(settings, src=src)
    except (RuntimeError, OSError) as error:
        why = f"its worker process failed to start: {str(error).strip().splitlines()[-1]}"
        return measure.RemoteContender(None, name, label, reason=why), why
    got = worker.info
    why = None
    if not os.path.realpath(got["file"]).startswith(os.path.realpath(src) + os.sep):
        why = f"its worker imported interlace from {got['file']}, not from {src}"
    elif not got["native"]:
        why = "its worker loaded the pure-Python twin, not the compiled extension"
    if why:
        worker.close()
        return measure.RemoteContender(None, name, label, reason=why), why
    return measure.RemoteContender(worker, name, label), None


def prepare_baseline(o) -> dict:
    """--baseline REF's tree exported and built (once for all runs): its info, with `skipped`
    saying why when it cannot be had."""
    made = B.prepare(o.baseline, measure.ROOT, o.baseline_dir, log=progress)
    if isinstance(made, str):
        return {"ref": o.baseline, "skipped": made, "label": f"interlace@{o.baseline} (native)"}
    return {"ref": made.ref, "sha": made.sha, "tree": made.tree, "label": made.label, "src": made.src}


def read_runs(files: list) -> list:
    """`--combine`: the single runs in these JSON files (checked to be one measurement's)."""
    each = []
    for path in files:
        try:
            with open(path) as f:
                one = json.load(f)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--combine: cannot read {path}: {error}") from None
        one.pop("markdown", None)
        if "runs" in one:
            raise SystemExit(f"--combine: {path} already combines {len(one['runs'])} runs; give the single runs")
        if each and one.get("settings") != each[0].get("settings"):
            raise SystemExit(f"--combine: {path} was measured with other settings than {files[0]} "
                             f"({one.get('settings')} against {each[0].get('settings')})")
        each.append(one)
    return each


def main(argv=None) -> int:
    o = parse(argv)
    each = read_runs(o.combine) if o.combine else measure_runs(o)
    if len(each) == 1:
        results = each[0]
    else:  # several runs read as one: medians and spreads (runs.py)
        results = {**runs.combine(each), "runs": each, "workers": [r.get("workers") for r in each],
                   "settings": {**each[0]["settings"], "runs": len(each)}}
        results["goals"] = report.goals(results)
        results["before_after"] = report.before_after(results)
    text = report.markdown(results)
    print(text)
    if o.combine and not o.json_given:
        return 0  # nothing measured: the default JSON (the last measurement) is left as it is
    os.makedirs(os.path.dirname(os.path.abspath(o.json)), exist_ok=True)
    with open(o.json, "w") as f:
        json.dump({**results, "markdown": text}, f, indent=1, default=str)
    progress(f"figures written to {o.json}")
    return 0


def measure_runs(o) -> list:
    """Every run of the measurement (`--runs N`), each one run's result."""
    settings = {"device": o.device, "dtype": o.dtype, "threads": o.threads}
    measure.configure(settings)
    wanted = set(o.contenders.split(",")) if o.contenders else None
    if wanted is not None and o.baseline:
        wanted.add("baseline")  # asked for by name
    baseline = prepare_baseline(o) if o.baseline else None
    # in this process, kept across runs (their wrappers and nnsight's copies are made once)
    here = [C.Raw(), C.Hooks(), Prototype(), GeneratorPrototype(), GeneratorCore(), GeneratorChecked(), C.Interlace(),
            C.NNsight(), C.TransformerLens()]
    each = []
    for i in range(o.runs):
        if o.runs > 1:
            progress(f"run {i + 1} of {o.runs}")
        each.append(measure_once(o, settings, here, wanted, baseline))
    return each


def measure_once(o, settings, here, wanted, baseline) -> dict:
    """One whole measurement, with worker processes of its own (started fresh, closed after).

    With a measured baseline, this tree's interlace runs in a worker too, of the same kind as
    the baseline's (compiled, its src/ first on the path): before and after alike."""
    raw, hooks, prototype, genproto, gencore, checked, interlace, nnsight, tlens = here
    everyone, workers = [raw, hooks, prototype, genproto, gencore], []
    if wanted is not None and "checked" in wanted:  # (only when named: its lines raise everyone's figures)
        everyone.append(checked)
    info = dict(baseline) if baseline else None
    try:
        if baseline and "skipped" not in baseline:
            progress(f"starting the baseline's worker process ({baseline['label']})")
            contender, why = native_worker(settings, baseline["src"], baseline["label"], "baseline")
            everyone.append(contender)
            if why:
                info["skipped"] = why
            else:
                workers.append(contender.worker)
        elif baseline:
            everyone.append(measure.RemoteContender(None, "baseline", baseline["label"],
                                                    reason=baseline["skipped"]))
        if workers and (wanted is None or "interlace" in wanted):
            # the baseline runs: this tree's interlace in a worker of the same kind
            progress("starting this tree's interlace in a worker process (beside the baseline's)")
            contender, why = native_worker(settings, os.path.join(measure.ROOT, "src"), "interlace", "interlace")
            everyone.append(contender)
            if not why:
                workers.append(contender.worker)
        elif not workers:
            everyone.append(interlace)
        if wanted is None or "twin" in wanted:
            progress("starting the twin's worker process")
            workers.append(measure.Worker(settings, twin=True))
            everyone.append(measure.RemoteContender(workers[-1]))
        everyone += [nnsight, tlens]
        return run(o, settings, everyone, wanted, info)
    finally:
        for worker in workers:
            worker.close()


def run(o, settings, everyone, wanted, baseline) -> dict:
    """Every selected workload for every available contender: the results (JSON-ready)."""
    active, skipped = [], {}
    for c in everyone:
        if wanted is not None and c.name not in wanted:
            continue
        why = c.unavailable()
        if why:
            skipped[c.label] = why
        else:
            active.append(c)
    for label, why in skipped.items():
        progress(f"skipping {label}: {why}")
    names = [c.name for c in active]
    labels = {c.name: c.label for c in everyone}
    sources = {"baseline": baseline["src"]} if "baseline" in names else {}
    workers = {c.name: c.worker.info["pid"] for c in active if getattr(c, "worker", None)}
    results = {
        "hardware": hardware(o), "settings": {**settings, "repeats": o.repeats, "shapes": o.shapes,
                                              "runs": o.runs},
        "contenders": names, "labels": labels, "baseline": baseline, "workers": workers,
        "versions": {c.name: c.version for c in active if c.version}, "skipped": skipped, "workloads": {},
    }
    pycache = workloads.pycache_dir()
    for wname in o.workloads:
        w = workloads.WORKLOADS[wname]
        if wname == "import":
            progress("import: fresh interpreters")
            which = [n for n in ("raw", "baseline", "interlace", "twin", "nnsight", "tlens") if n in names or n == "raw"]
            if "nnsight" in which or "tlens" in which:
                which.append("torch")  # what they import first, for scale
            rows = workloads.import_times(which, max(1, o.repeats // 10), pycache, warm=o.repeats > 2,
                                          sources=sources, labels=labels)
            results["workloads"][wname] = {
                "title": w.title, "goal": w.goal, "rows": rows,
                "columns": ["wall_ms", "min_wall_ms", "cpu_ms", "over_empty_wall_ms", "over_empty_cpu_ms"]}
        elif wname == "cold_start":
            which = [n for n in ("baseline", "interlace", "twin", "nnsight", "tlens") if n in names]
            shape = workloads.pick(o, "gpt2-small")
            progress(f"cold_start: fresh processes, {shape}")
            rows = workloads.cold_start(which, shape, max(1, o.repeats // 25), settings, pycache,
                                        warm=o.repeats > 2, sources=sources)
            results["workloads"][wname] = {
                "title": f"{w.title}, {shape}", "goal": w.goal, "rows": rows,
                "columns": ["import_ms", "wrap_ms", "first_ms", "new_site_ms", "warm_ms"]}
        elif wname == "peak_memory":
            results["workloads"][wname] = peak(w, w.cases(o), active, settings)
        else:
            cases = w.cases(o)
            entry = timed(w, cases, active, settings, o)
            if wname == "edit_slope":
                entry["summary"] = slopes(entry, cases)
            if wname == "as_module":
                entry["exported"] = exported_over_trace(entry, cases)
            if wname == "sweep_item" and cases:
                entry["per_item"] = per_item(entry, cases[0])
            if wname == "wrapped":
                entry["structural"] = wrapped_structure(cases[0], active, settings)
            results["workloads"][wname] = entry
    results["goals"] = report.goals(results)
    results["before_after"] = report.before_after(results)
    return results


def slopes(entry, cases) -> dict:
    """us per edit (slope over k) per contender, and its ratio to plain hooks' slope.

    The slope is taken over each contender's cost above the raw forward of the same rounds
    (`over_raw_us`), not over its own times: the k cases run one after another, and the
    machine's drift between them (on a shared machine, milliseconds) would swamp an edit's
    cost; within a round it hits the raw forward alike and cancels."""
    ks = [case.args[0] for case in cases]
    rows = list(entry["cases"].values())
    key = "over_raw_us" if all("over_raw_us" in row.get("hooks", {}) for row in rows) else "median_us"
    out = {}
    for name in rows[0]:
        if name == "raw" or len(ks) < 2 or any(key not in row.get(name, {}) for row in rows):
            continue  # (a contender that failed a case has no slope)
        out[name] = {"per_edit_us": workloads.slope(ks, [row[name][key] for row in rows])}
        if key == "over_raw_us" and all("own_floor_over_raw_us" in row[name] for row in rows):
            # a worker's contender: against plain hooks' slope in its own process
            out[name]["floor_per_edit_us"] = workloads.slope(ks, [row[name]["own_floor_over_raw_us"] for row in rows])
    ref = out.get("hooks", {}).get("per_edit_us")
    for row in out.values():  # (plain hooks' slope lost in noise, at or below 0: no ratio)
        floor = row.get("floor_per_edit_us", ref)
        row["ratio"] = row["per_edit_us"] / floor if floor and floor > 0 else None
    return out


def per_item(entry, case) -> dict:
    """The sweep probe's figures, us per item: the floor's own (and above the raw forward), and
    each contender's over the floor (the median of the per-round differences over the item
    count; a worker's against the floor timed in its own process)."""
    row, floor = entry["cases"][case.label], case.floor
    out = {}
    if "median_us" in row.get(floor, {}):
        out[floor] = {"us": row[floor]["median_us"], "over_raw_us": row[floor].get("over_raw_us")}
    for name, cell in row.items():
        if name not in (floor, "raw") and "overhead_us" in cell:
            own = cell.get("own_floor_us")
            out[name] = {"over_floor_us": cell["overhead_us"], "own": own is not None,
                         "floor_us": own if own is not None else row[floor]["median_us"]}
    return out


def exported_over_trace(entry, cases) -> dict:
    """{contender: {shape: a call of as_module()'s module / a trace with the same edits}}: the
    quotient of their ratios to plain hooks (each ratio taken in its own case's rounds, so the
    drift between the two cases cancels)."""
    out = {}
    for case in cases:
        if case.args != ("module",):
            continue
        trace_label = case.label.rsplit(", ", 1)[0] + ", trace"
        mine, theirs = entry["cases"].get(case.label, {}), entry["cases"].get(trace_label, {})
        for name, row in mine.items():
            a, b = row.get("ratio") if isinstance(row, dict) else None, theirs.get(name, {}).get("ratio")
            if name not in ("raw", "hooks") and a and b:
                out.setdefault(name, {})[case.shape] = a / b
    return out


def wrapped_structure(case, active, settings) -> dict:
    """What each wrapper left on its module outside a trace (workloads.structural)."""
    s = subjects.build(case.shape, settings["device"], settings["dtype"])
    out = {}
    for c in active:
        if isinstance(c, measure.RemoteContender):  # the twin, the baseline: their own process
            out[c.name] = c.structural(case.shape)
        elif c.name == "interlace":
            out[c.name] = workloads.structural(s.module)
        elif c.name == "nnsight":
            out[c.name] = workloads.structural(c.model(s)._module)
    return out


if __name__ == "__main__":
    sys.exit(main())
