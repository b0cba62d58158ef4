"""The workloads: what is measured, on which shapes, against which floor, and their summaries.

Timed workloads are lists of `Case`s (one table row each); every contender that can do a
case's operation is timed on it in the same rounds (measure.interleaved). Three workloads
run in fresh processes or measure memory instead (`import`, `cold_start`, `peak_memory`).

  save_one     save one layer's output                   every shape
  zero_mlps    zero every MLP's output, save the logits  every shape
  save_all     save every layer's output                 every shape
  edit_slope   zero k MLPs, k = 1..12: us per edit, against plain hooks' us per edit
  as_module    the zero_mlps edit recorded by model.edit(): a trace of the edited wrapper,
               and a call of the module edited.as_module() exports
  invokes      n = 1..32 invokes saving layer 0, against one batch with a plain hook
  generate     16 new tokens reading the logits at every step with `tracer.iter[:]`
  fixed        the fixed cost of one trace: a 2x2 Linear, save its output
  sweep_item   issue 20's sweep probe: every (layer, position) patched from a clean run, x8,
               batch 64; us per item, against plain hooks hand-batched at 64
  wrapped      the wrapped model called outside a trace, against the bare module
  tracer       a warm `interlace.Tracer` with a do-nothing backend, against `nullcontext`
  datasets     activation collection to disk: model.sweep(save_to=) against a hooks loop
  peak_memory  bytes a save-every-layer trace needs above what was in use, against a forward
  cold_start   fresh process: import the library, wrap, first trace, first trace at a new site
  import       `import <library>` in a fresh interpreter, against an empty interpreter

Each workload that answers one of issues 8's and 20's goals says which (`Workload.goal`); the report
prints it under the workload's table, and its goals table reads the figures (report.GOALS).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from . import subjects
from .contenders import ENTRIES


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    op: str
    shape: str
    args: tuple = ()
    floor: str = "hooks"   # the contender the ratios are taken against
    per_call: int = 1      # the callable repeats the work this many times


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    cases: object             # (options) -> [Case]
    rounds: float = 1.0       # share of --repeats this workload runs (costly ones run fewer)
    goal: str | None = None   # the goal (issue 8's, 20's) it answers (None: reported, no target)


def pick(options, preferred: str) -> str:
    """`preferred` if selected, else the first selected GPT-2 shape, else the first shape."""
    shapes = [s for s in options.shapes if s != "linear"]
    if preferred in shapes:
        return preferred
    return next((s for s in shapes if subjects.SHAPES[s].arch == "gpt2"), shapes[0])


def _per_shape(op):
    return lambda o: [Case(s, op, s) for s in o.shapes if s != "linear"]


def _slope_cases(o):
    """k = 1..12 on a 12-layer model: on a GPU GPT-2 small (launch-bound, so each edit shows);
    on a CPU `tiny12`, whose ~3 ms forward keeps round-to-round noise below one edit's cost
    (GPT-2 small's 110 ms forward wanders by milliseconds, 30x a plain hook's edit)."""
    cuda = str(getattr(o, "device", "cpu")).startswith("cuda")
    shape = "gpt2-small" if cuda and "gpt2-small" in o.shapes else "tiny12"
    return [Case(f"{shape}, k={k}", "zero_mlps", shape, (k,)) for k in range(1, subjects.SHAPES[shape].layers + 1)]


def _sweep_case(shape):
    """One call does the whole sweep; its figures are per item (the item count: per_call)."""
    items = subjects.SHAPES[shape].layers * subjects.SHAPES[shape].tokens * SWEEP_REPEAT
    return Case(f"{shape}, {items} items", "sweep_item", shape, (SWEEP_REPEAT, SWEEP_BATCH), per_call=items)


INVOKES = (1, 2, 4, 8, 16, 32)
SWEEP_REPEAT, SWEEP_BATCH = 8, 64  # sweep_item: every (layer, position) cell 8 times, batches of 64
# `collect` (issue 22): (tokens per window, windows per call). 128 tokens is the shape of
# activation collection (SAE training data is cut into windows of 128 tokens or more); 16
# tokens is its stress case, where the forward is so short that a sweep item's own cost shows.
COLLECT = ((128, 512), (16, 1024))
NEW_TOKENS = 16

WORKLOADS = {
    w.name: w for w in (
        Workload("save_one", "Save one layer's output", _per_shape("save_one"),
                 goal="tiny: ≤ 1.03x plain hooks, and within +20 us of the prototype contender (issue 20)"),
        Workload("zero_mlps", "Zero every MLP output, save the logits", _per_shape("zero_mlps"),
                 goal="tiny: ≤ 1.05x plain hooks (issue 20)"),
        Workload("save_all", "Save every layer's output", _per_shape("save_all"),
                 goal="tiny: ≤ 1.05x plain hooks (issue 8)"),
        Workload("edit_slope", "Zero k MLPs, k = 1..12: the cost of each edit", _slope_cases, rounds=0.6,
                 goal="each edited location ≤ 2x what a plain hook's edit costs (least-squares slope over k; "
                      "issue 8)"),
        Workload("as_module", "Zero every MLP by model.edit(), read the logits: a trace of the edited "
                              "wrapper, and a call of edited.as_module()",
                 lambda o: [Case(f"{shape}, {how}", "edited", shape, (how,))
                            for shape in o.shapes if shape != "linear" and subjects.SHAPES[shape].arch == "gpt2"
                            for how in ("trace", "module")],
                 rounds=0.5, goal="a call of the exported module ≤ 1.05x a trace with the same edits "
                                  "(each as x plain hooks, then their quotient; issue 23)"),
        Workload("invokes", "n invokes saving layer 0 (plain hooks: one batch of n rows)",
                 lambda o: [Case(f"{pick(o, 'tiny')}, n={n}", "invokes", pick(o, "tiny"), (n,)) for n in INVOKES],
                 rounds=0.5, goal="16 invokes ≤ 1.15x the plain-hook batch (issue 20)"),
        Workload("generate", f"Generate {NEW_TOKENS} tokens, read the logits at every step (tracer.iter[:])",
                 lambda o: [Case(pick(o, "tiny"), "generate", pick(o, "tiny"), (NEW_TOKENS,))], rounds=0.25),
        Workload("fixed", "Fixed cost of a trace: 2x2 Linear, save its output",
                 lambda o: [Case("linear", "fixed", "linear")],
                 goal="≤ +30 us over plain hooks (issue 20)"),
        Workload("sweep_item", f"Sweep probe: every (layer, position) patched from a clean run, "
                               f"x{SWEEP_REPEAT}, batch {SWEEP_BATCH}, a logit difference saved (us per item; "
                               f"floor: plain hooks hand-batched at {SWEEP_BATCH})",
                 lambda o: [_sweep_case(pick(o, "tiny"))], rounds=0.3,
                 goal="≤ 30 us per item over the floor (issue 20; its done-when bound: 40)"),
        Workload("wrapped", "Wrapped model called outside a trace (floor: the bare module)",
                 lambda o: [Case(s, "wrapped", s, floor="raw") for s in o.shapes if s != "linear"][:1],
                 goal="no hooks and the module's own forward (structural check); its cost reported in us "
                      "(issue 8)"),
        Workload("tracer", f"Warm Tracer, do-nothing backend, per entry (floor: nullcontext; {ENTRIES} entries a call)",
                 lambda o: [Case("tiny body", "noop_tracer", "linear", floor="raw", per_call=ENTRIES)],
                 goal="native path ≤ 2x nullcontext (the twin is reported, not held to it; issue 8)"),
        Workload("datasets", "Activation collection to disk: windows of 128 and of 16 tokens, the "
                             "first and last layers' outputs written as Arrow files (us per row; "
                             "floor: a hand-written hooks loop writing the same files, "
                             "probes/datasets.py)",
                 lambda o: [Case(f"{pick(o, 'tiny')}, {tokens} tokens x {items}", "collect",
                                 pick(o, "tiny"), (items, tokens), per_call=items)
                            for tokens, items in COLLECT],
                 rounds=0.1, goal="128-token windows: ≤ 1.2x the hooks loop (issue 22; the 16-token "
                                  "stress case is reported)"),
        Workload("peak_memory", "Peak tensor memory of saving every layer, above a raw forward's",
                 lambda o: [Case(pick(o, "gpt2-small"), "save_all", pick(o, "gpt2-small"), floor="raw")]),
        Workload("cold_start", "Cold start in a fresh process (ms)", None),
        Workload("import", "`import <library>` in a fresh interpreter (ms)", None,
                 goal="`import interlace` ≤ 30 ms more than an empty interpreter (wall; issue 8)"),
    )
}


def slope(ks: list, us: list) -> float:
    """Least-squares slope of us against k."""
    mk, mu = statistics.fmean(ks), statistics.fmean(us)
    return sum((k - mk) * (u - mu) for k, u in zip(ks, us)) / sum((k - mk) ** 2 for k in ks)


def structural(module) -> list:
    """What a wrapped model outside a trace left on `module` that a bare module would not have:
    hooks, or a `forward` that is not its class's (empty: it is the bare module)."""
    from torch.nn.modules import module as torch_module

    found = []
    for name, m in module.named_modules():
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            if getattr(m, kind, None):
                found.append(f"{name or 'root'}: {kind}")
        if "forward" in m.__dict__:
            found.append(f"{name or 'root'}: forward replaced")
    for kind in ("_global_forward_hooks", "_global_forward_pre_hooks"):
        if getattr(torch_module, kind, None):
            found.append(f"torch global {kind}")
    return found


# -- fresh processes: import and cold start ----------------------------------------------------

IMPORTS = {
    "raw": ("empty interpreter", "pass", {}),
    "interlace": ("interlace", "import interlace", {}),
    "twin": ("interlace twin", "import interlace", {"INTERLACE_NO_EXTENSIONS": "1"}),
    "baseline": ("interlace baseline", "import interlace", {"INTERLACE_REQUIRE_EXTENSIONS": "1"}),
    "nnsight": ("nnsight (imports torch)", "import nnsight", {}),
    "tlens": ("TransformerLens (imports torch)", "import transformer_lens", {}),
    "torch": ("torch (for scale)", "import torch", {}),
}


def fresh_env(pycache: str, extra: dict | None = None, src: str | None = None) -> dict:
    """The environment of a fresh process: compiled bytecode cached as in an installed
    package (PYTHONDONTWRITEBYTECODE would make every import compile its sources). `src`:
    the interlace it imports (a baseline's tree), else this checkout's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLACE_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if src:
        env["INTERLACE_BENCH_SRC"] = src  # benchmarks/__init__.py puts it first on sys.path
    env["PYTHONPATH"] = os.pathsep.join([root, src or os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    env["PYTHONPYCACHEPREFIX"] = pycache
    env.update(extra or {})
    return env


class ChildFailed(RuntimeError):
    """A fresh process of one contender failed: reported in its row, the others go on."""

    def row(self) -> dict:
        lines = [line for line in str(self).splitlines() if line.strip()]
        print(f"[bench]   {lines[0]}\n[bench]   {lines[-1]}", file=sys.stderr, flush=True)
        return {"error": lines[-1]}


def _child_run(argv, env) -> tuple:
    """(wall s, CPU s, stdout) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise ChildFailed(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout


def import_times(names: list, repeats: int, pycache: str, warm: bool = True, sources: dict | None = None,
                 labels: dict | None = None) -> dict:
    """{name: row} of `python -c "import X"`, the processes taking turns, ms: wall (median and
    min) and CPU (median), each also over the empty interpreter's. `warm`: one unmeasured run
    each first, filling the bytecode and file caches (smoke runs skip it). `sources`: {name:
    the src/ it imports} (the baseline); `labels`: {name: label} over IMPORTS' own."""
    sources, labels = sources or {}, labels or {}
    envs = {n: fresh_env(pycache, IMPORTS[n][2], sources.get(n)) for n in names}
    walls, cpus, failed = {n: [] for n in names}, {n: [] for n in names}, {}
    for round_ in range(repeats + warm):
        for n in names:
            if n in failed:
                continue
            try:
                wall, cpu, _ = _child_run([sys.executable, "-c", IMPORTS[n][1]], envs[n])
            except ChildFailed as error:
                failed[n] = error.row()
                continue
            if round_ >= warm:  # the first round of a warm run fills the caches, unmeasured
                walls[n].append(wall * 1e3)
                cpus[n].append(cpu * 1e3)
    base_wall, base_cpu = statistics.median(walls["raw"]), statistics.median(cpus["raw"])
    label = {n: labels.get(n) if n in sources else IMPORTS[n][0] for n in names}
    return {n: {"label": label[n], **failed[n]} if n in failed else {
                "label": label[n], "wall_ms": statistics.median(walls[n]), "min_wall_ms": min(walls[n]),
                "cpu_ms": statistics.median(cpus[n]),
                "over_empty_wall_ms": statistics.median(walls[n]) - base_wall,
                "over_empty_cpu_ms": statistics.median(cpus[n]) - base_cpu}
            for n in names}


def cold_start(names: list, shape: str, repeats: int, settings: dict, pycache: str,
               warm: bool = True, sources: dict | None = None) -> dict:
    """{name: row of median ms} from `benchmarks.coldstart` run `repeats` times per contender,
    the contenders taking turns (`warm`: after one unmeasured run each). `sources`: {name:
    the src/ it imports} (the baseline)."""
    sources = sources or {}
    envs = {n: fresh_env(pycache, IMPORTS[n][2] if n in ("twin", "baseline") else {}, sources.get(n))
            for n in names}
    argv = [sys.executable, "-m", "benchmarks.coldstart", "--shape", shape, "--device", settings["device"],
            "--dtype", settings["dtype"], "--threads", str(settings.get("threads") or 0)]
    samples, rows = {n: [] for n in names}, {}
    for round_ in range(repeats + warm):
        for n in names:
            if n in rows:
                continue
            try:  # a warm run's first round fills the bytecode cache, unmeasured
                _, _, out = _child_run(argv + ["--contender", n] + (["--sites", "1"] if round_ < warm else []),
                                       envs[n])
            except ChildFailed as error:
                rows[n] = error.row()
                continue
            if round_ >= warm:
                samples[n].append(json.loads(out.strip().splitlines()[-1]))
    for n, runs in samples.items():
        if n not in rows:
            rows[n] = {key: statistics.median([r[key] for r in runs if r.get(key) is not None])
                       for key in runs[0] if any(r.get(key) is not None for r in runs)}
    return {n: rows[n] for n in names}


def pycache_dir() -> str:
    return tempfile.mkdtemp(prefix="interlace-bench-pyc-")
