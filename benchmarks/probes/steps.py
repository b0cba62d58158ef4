"""Where one warm trace's instructions go, step by step, counted with callgrind (not timed).

    python benchmarks/probes/steps.py              # tiny GPT-2, save layer 0's output (save_one)
    python benchmarks/probes/steps.py --traces 20  # more traces (the counts barely move)
    python benchmarks/probes/steps.py --forward identity  # a forward of no torch op: whole
                                                          # counts stable to a few hundred
    python benchmarks/probes/steps.py --cache      # + each step's simulated L1 and L2 misses
    python benchmarks/probes/steps.py --footprint  # the distinct cache lines of whole calls
    python benchmarks/probes/steps.py --invokes 16  # a trace of 16 invokes (the harness's
                                                    # `invokes` workload) on the general run

Issue 20 asks for interlace's fixed steps measured one by one against the prototype (a tapped,
reused greenlet written by hand, `benchmarks/prototype.py`). Timing them one by one is hopeless
on a noisy 2-core VM; counting instructions is exact and load-independent. The probe runs
itself under `valgrind --tool=callgrind` with collection off, then, around each warm trace:

* wraps interlace's steps (the functions in STEPS) so that each call marks its start and end
  with a callgrind dump (a client request through a 10-line C helper built here with the
  system's compiler and `valgrind/callgrind.h`);
* adds the instructions between marks to every step open at that moment (per greenlet: a body
  parked in `wait` is not "inside" the model side's steps), minus the marks' own cost
  (calibrated on an empty wrapped function);
* counts the raw forward, plain hooks and the prototype the same way, whole.

Rows are inclusive instructions per trace (a step's callees included; indentation shows
nesting as first seen) and calls per trace. "trace, whole" is interlace's full `with` block.
Needs valgrind, its headers and a C compiler; says so and exits 0 when one is missing.
Instruction counts are not time: after a forward evicts the caches a step's instructions run
about 4x slower than in a tight loop, so they rank the steps, they do not price them.

`--cache` simulates this machine's L1 and L2 caches (sizes from /sys; valgrind's own guess
would take the 480 MB L3 as the last level) and adds two columns: L1 misses and L2 misses,
the cache lines a step fetches from beyond L1 and beyond L2. On tiny GPT-2 the L2 misses are
what prices a trace: the forward's working set nearly fills L2, so every line a trace brings
in evicts one of the model's, which its matmuls fetch again (the "raw forward" row of a
trace's run shows them). `--footprint` flushes the simulated caches (an 8 MB read, not
counted) before each whole call, so that its L2 misses are the distinct lines it touches: the
trace's own footprint, which the forward's lines must make room for. Its rows go layer by
layer: the prototypes, the tracer core around the generator prototype (`gencore`), interlace
with an empty body, reading the root's output, reading the block through an Envoy looked up
before the block, the whole save-one trace (an express run, intervention/express.py), the
same trace on the general run, and last (so that the other rows' dumps keep their numbers) the
tracer core driving `engine_floor.py`'s checked engine: the express run's mechanism with the
checks it cannot do without, written plainly.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# (module, attribute path) of each step wrapped: one warm `save_one` trace's path through the
# tracer core, the engine, the interleaver and the mediator.
STEPS = [
    ("interlace.models.model", "Model.trace"),
    ("interlace.intervention.tracer", "_InterleavingBackend.__call__"),
    ("interlace.tracing.tracer", "Tracer.defer"),
    ("interlace.intervention.body", "BodyJob.__init__"),
    ("interlace.intervention.engine", "Engine.interleave"),
    ("interlace.intervention.interleaver", "Interleaver.reset"),
    ("interlace.intervention.interleaver", "Interleaver.add"),
    ("interlace.intervention.interleaver", "Interleaver.run"),
    ("interlace.intervention.interleaver", "Interleaver._start"),
    ("interlace.intervention.interleaver", "Interleaver._teardown"),
    ("interlace.intervention.interleaver", "Interleaver.read"),
    ("interlace.intervention.hooks", "install"),
    ("interlace.intervention.hooks", "_hook"),
    ("interlace.intervention.hooks", "_tappable"),
    ("interlace._native", "hotpath.Hub"),
    ("interlace.intervention.hooks", "remove"),
    ("interlace.intervention.mediator", "Mediator._release"),
    ("interlace.tracing.skip", "write_back"),
    ("interlace.tracing.skip", "release_locals"),
    ("interlace.intervention.mediator", "Mediator.start"),
    ("interlace.intervention.mediator", "Mediator._job"),
    ("interlace.intervention.body", "BodyJob.__call__"),
    ("interlace.intervention.envoy", "Envoy.__getitem__"),
    ("interlace.intervention.compiled", "force_eager"),
    ("interlace.intervention.interleaver", "Interleaver._run"),
    ("interlace.intervention.tracer", "InterleavingTracer.__init__"),
    ("interlace.tracing.deferred", "DeferredBody.run"),
    ("interlace.tracing.tracer", "Tracer.push_result"),
    ("interlace.intervention.tracer", "InterleavingTracer.release"),
    # the generator route's (routes.py): the body started, its end (each read's send is
    # GenCore.switch, in the compiled extension: not wrappable)
    ("interlace.intervention.mediator", "GeneratorMediator.start"),
    ("interlace.intervention.mediator", "GenWorker.__init__"),
    ("interlace.intervention.mediator", "GenWorker.returned"),
    ("interlace.intervention.mediator", "GenWorker.failed"),
    ("interlace.intervention.body", "BodyJob.generator"),
    ("interlace.intervention.body", "BodyJob.finish"),
    ("interlace.intervention.interleaver", "Interleaver.generator_read"),
    ("interlace.intervention.envoy", "Envoy.__interlace_read__"),
    # the express run's (express.py): the warm generator-body trace without the general run
    # (`run` and its per-module steps, `ahead`, `serve`, `switch`, are hotpath.ExpressCore's:
    # compiled; wrapping `Express.run` times the compiled run whole)
    ("interlace.intervention.express", "Express.run"),
    ("interlace.intervention.express", "Express._wrap"),
    ("interlace.intervention.express", "Express.generator_read"),
    ("interlace.intervention.express", "Express._after_return"),
    ("interlace.intervention.express", "Express._returned"),
    ("interlace.tracing.generators", "read"),
    # --invokes: the invokes collected by the trace's body, batched, run on the general run
    ("interlace.intervention.tracer", "_InterleavingBackend.run_invokes"),
    ("interlace.tracing.tracer", "Tracer.run_body"),
    ("interlace.intervention.tracer", "_InvokeBackend.__call__"),
    ("interlace.intervention.tracer", "_InterleavingBackend._interleave"),
    ("interlace.intervention.routes", "eligible"),
    ("interlace.intervention.engine", "Engine._build"),
    ("interlace.models.inputs", "PromptBatcher.batch_invokes"),
    ("interlace.intervention.interleaver", "Interleaver.add_all"),
    ("interlace.intervention.interleaver", "Interleaver._setup"),
    ("interlace.intervention.interleaver", "Interleaver._forward"),
    ("interlace.intervention.interleaver", "Interleaver.narrowed"),
    ("interlace.intervention.interleaver", "Interleaver._end"),
]

HELPER = r"""
#include <valgrind/callgrind.h>
void il_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
void il_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
void il_mark(void) { CALLGRIND_DUMP_STATS; }
void il_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def build_helper(folder):
    """The marks' C helper, or a line saying why it cannot be had."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if shutil.which("valgrind") is None:
        return None, "valgrind is not installed"
    if cc is None:
        return None, "no C compiler (cc/gcc) to build the marks' helper"
    source = os.path.join(folder, "marks.c")
    library = os.path.join(folder, "libmarks.so")
    with open(source, "w") as f:
        f.write(HELPER)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", library, source],
                          capture_output=True, text=True)
    if done.returncode:
        return None, f"the marks' helper did not build (valgrind's headers?): {done.stderr.strip()[:200]}"
    return library, None


# -- inside callgrind ---------------------------------------------------------------------

class _Identity:
    """`--forward identity`: a two-block net whose forward runs no torch op, so that the whole
    trace's count is interlace's alone. With tiny GPT-2 the count moves by +-30k between
    builds that change nothing in the forward: MKL's matmul takes different paths with the
    tensors' alignment, which every allocation before it moves."""

    @staticmethod
    def build(torch):
        class Block(torch.nn.Module):
            def forward(self, x):
                return x

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.h = torch.nn.ModuleList([Block(), Block()])

            def forward(self, x):
                for block in self.h:
                    x = block(x)
                return x

        return Net().eval(), torch.zeros(1, 4)


def inside(folder, traces, forward="gpt2", footprint=False, invokes=0):
    import ctypes

    import torch
    from greenlet import getcurrent

    sys.path.insert(0, os.path.join(ROOT, "src"))
    sys.path.insert(0, ROOT)
    import interlace
    from transformers import GPT2Config, GPT2LMHeadModel

    marks = ctypes.CDLL(os.path.join(folder, "libmarks.so"))
    mark = marks.il_mark
    log = []  # (step, +1 start / -1 end, greenlet id), in the order of the dumps
    on = [False]

    def wrap(name, fn):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            if not on[0]:
                return fn(*args, **kwargs)
            who = id(getcurrent())
            log.append((name, 1, who))
            mark()
            try:
                return fn(*args, **kwargs)
            finally:
                log.append((name, -1, who))
                mark()
        return step

    import importlib
    for module_name, path in STEPS:
        module = importlib.import_module(module_name)
        owner = module
        *parents, attr = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        setattr(owner, attr, wrap(path, getattr(owner, attr)))

    def empty():
        return None

    calibrate = wrap("calibrate", empty)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if forward == "identity":
        module, ids = _Identity.build(torch)
        model = interlace.Model(module)
        block = module.h[0]

        def trace():
            with model.trace(ids):
                out = model.h[0].output.save()
            return out
    else:
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, bos_token_id=0,
                            eos_token_id=0)
        module = GPT2LMHeadModel(config).eval()
        ids = torch.randint(0, 1000, (1, 16))
        model = interlace.Model(module)
        block = module.transformer.h[0]

        def trace():
            with model.trace(ids):
                out = model.transformer.h[0].output.save()
            return out

        if invokes:  # the harness's `invokes` workload: one row each, read as one batch
            rows = list(torch.randint(0, 1000, (invokes, 1, 16)))
            ids = torch.cat(rows)
            lm = interlace.LanguageModel(module)

            def trace():
                with lm.trace() as tracer:
                    hs = interlace.save([])
                    for row in rows:
                        with tracer.invoke(row):
                            hs.append(lm.transformer.h[0].output)
                return hs

    whole = wrap("trace, whole", trace)

    def raw():
        return module(ids)

    from benchmarks.probes.engine_floor import saved_by_hook

    def hooks():
        return saved_by_hook(module, block, ids)

    from benchmarks.prototype import Tap

    tap = Tap()

    def prototype():
        return tap.run([block], lambda: tap.wait(block), lambda: module(ids))

    # --footprint's layers: the generator prototype, then interlace's tracer core around it
    # (the harness's gencore), then interlace with an empty body, reading the root's output
    # (no tap), reading block 0's output through an Envoy looked up before the block, and the
    # whole trace (block 0 tapped, and its container), then the same on the general run
    from benchmarks.prototype import Bare, GeneratorCore, GeneratorPrototype

    bare = Bare(module, ids, block)
    genproto = GeneratorPrototype().save_one(bare)
    gencore = GeneratorCore().save_one(bare)
    checked = None
    if forward == "gpt2":  # the tracer core driving engine_floor.py's CheckedEngine (GPT-2's chain)
        from benchmarks.probes.engine_floor import checked_trace

        checked = checked_trace(module, ids)

    def empty():
        with model.trace(ids):
            pass

    def root_output():
        with model.trace(ids):
            out = model.output.save()
        return out

    envoy = model.h[0] if forward == "identity" else model.transformer.h[0]

    def fetched():  # the save-one trace with its Envoy looked up before the block
        with model.trace(ids):
            out = envoy.output.save()
        return out

    from interlace.intervention import engine as engine_module

    express = engine_module._EXPRESS

    def general():  # the save-one trace on the general run (no express run: INTERLACE_EXPRESS=0)
        engine_module._EXPRESS = False
        try:
            return trace()
        finally:
            engine_module._EXPRESS = express

    totals = {}
    with torch.no_grad():
        for fn in (raw, hooks, prototype, whole, calibrate, genproto, gencore, empty, root_output,
                   fetched, general, *([checked] if checked else [])):
            for _ in range(30):
                fn()
        if footprint:  # every call starts with cold caches: its L2 misses are its distinct lines
            flush = torch.ones(8 * 1024 * 1024 // 4)  # 8 MB, read outside the count
            for name, fn in (("raw forward", raw), ("plain hooks", hooks), ("prototype", prototype),
                             ("generator prototype", genproto), ("tracer core + it (gencore)", gencore),
                             ("interlace, empty body", empty), ("interlace, the root's output", root_output),
                             ("interlace, the block's Envoy fetched before", fetched),
                             ("trace, whole", trace), ("the same on the general run", general),
                             *([("tracer core + a checked engine (engine_floor.py)", checked)] if checked else [])):
                marks.il_start()
                marks.il_toggle()
                for _ in range(traces):
                    flush.sum()
                    marks.il_toggle()
                    fn()
                    marks.il_toggle()
                marks.il_toggle()
                marks.il_stop()
                totals[name] = traces
        else:
            for name, fn in (("raw forward", raw), ("plain hooks", hooks), ("prototype", prototype)):
                marks.il_start()
                for _ in range(traces):
                    fn()
                marks.il_stop()
                totals[name] = traces
            on[0] = True
            marks.il_start()
            for _ in range(traces):
                calibrate()
            for _ in range(traces):
                whole()
            marks.il_stop()
    with open(os.path.join(folder, "log.json"), "w") as f:
        json.dump({"log": log, "totals": list(totals), "traces": traces}, f)


# -- outside: run, parse, print ------------------------------------------------------------

def dumps(folder):
    """Each dump's counts, in order (callgrind numbers them .1, .2, ...): (instructions,
    L1 misses, L2 misses), the misses 0 without `--cache`."""
    names = [n for n in os.listdir(folder) if n.startswith("cg.out.")]
    names.sort(key=lambda n: int(n.rsplit(".", 1)[1]))
    counts = []
    for name in names:
        events = None
        with open(os.path.join(folder, name)) as f:
            for line in f:
                if line.startswith("events:"):
                    events = line.split()[1:]
                elif line.startswith("totals:"):
                    got = dict(zip(events, map(int, line.split()[1:])))
                    counts.append(Counts(got["Ir"],
                                         sum(got.get(e, 0) for e in ("I1mr", "D1mr", "D1mw")),
                                         sum(got.get(e, 0) for e in ("ILmr", "DLmr", "DLmw"))))
                    break
    return counts


class Counts(tuple):
    """(instructions, L1 misses, L2 misses), added and scaled as one."""

    def __new__(cls, *values):
        return super().__new__(cls, values)

    def __add__(self, other):
        return Counts(*(a + b for a, b in zip(self, other)))

    def __sub__(self, other):
        return Counts(*(a - b for a, b in zip(self, other)))

    def scaled(self, k):
        return Counts(*(a * k for a in self))


ZERO = Counts(0, 0, 0)


def _read(folder, name):
    with open(os.path.join(folder, name)) as f:
        return f.read().strip()


def cache_options():
    """valgrind's cache options for this machine's L1 data, L1 instruction and L2 caches."""
    found = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(base)):
            path = os.path.join(base, index)
            try:
                level, kind, size, ways, line = (_read(path, name) for name in (
                    "level", "type", "size", "ways_of_associativity", "coherency_line_size"))
                size = int(size.rstrip("K")) * 1024
                ways, line = int(ways), int(line)
            except (OSError, ValueError):
                continue
            name = {("1", "Data"): "D1", ("1", "Instruction"): "I1", ("2", "Unified"): "LL"}.get((level, kind))
            if name:
                found[name] = f"--{name}={size},{ways},{line}"
    except OSError:
        pass
    defaults = {"D1": "--D1=49152,12,64", "I1": "--I1=65536,16,64", "LL": "--LL=2097152,16,64"}
    return ["--cache-sim=yes"] + [found.get(name, default) for name, default in defaults.items()]


def table(folder, forward="gpt2", cache=False, invokes=0):
    with open(os.path.join(folder, "log.json")) as f:
        data = json.load(f)
    counts = dumps(folder)
    traces = data["traces"]
    whole = {name: counts[i].scaled(1 / traces) for i, name in enumerate(data["totals"])}
    if not data["log"]:  # --footprint: whole calls only, each from cold caches
        footprint_table(whole, forward, traces)
        return
    # The marked run: its first dump ends at the first mark; each later one at the next mark.
    marked = counts[len(data["totals"]):]
    log = data["log"]
    segments = marked[1:len(log)]  # segment i lies between log[i] and log[i + 1]
    main = log[0][2]  # the model side's greenlet (the first step starts there)
    inclusive, calls, depth, order, inner = {}, {}, {}, [], {}
    stacks = {}
    for i, (name, kind, who) in enumerate(log):
        stack = stacks.setdefault(who, [])
        if kind == 1:
            if name not in depth:
                depth[name] = len(stacks[main]) + (len(stack) if who != main else 0)
                order.append(name)
                inclusive[name] = ZERO
                inner[name] = 0
            stack.append(name)
            calls[name] = calls.get(name, 0) + 1
        else:
            stack.remove(name)
        if i >= len(segments):
            continue
        # A segment counts for the model side's open steps always (a body it switched to runs
        # inside them), and for a body's open steps only when the body ran all of it (not
        # while it was parked and the model ran).
        for g, stack in stacks.items():
            if g != main and not (who == g and log[i + 1][2] == g):
                continue
            for open_name in set(stack):
                inclusive[open_name] = inclusive[open_name] + segments[i]
                inner[open_name] += 1
    # One mark's own cost: an empty wrapped call is its two marks and nothing else.
    per_mark = inclusive["calibrate"].scaled(1 / calls["calibrate"])
    rows = []
    raw = whole["raw forward"]
    rows.append(("raw forward", 1, raw, None))
    for name in ("plain hooks", "prototype"):
        rows.append((name, 1, whole[name], whole[name] - raw))
    for name in order:
        if name == "calibrate":
            continue
        own = (inclusive[name] - per_mark.scaled(inner[name])).scaled(1 / traces)
        over = own - raw if name == "trace, whole" else None
        rows.append((("  " * depth[name]) + name, calls[name] / traces, own, over))
    shape = "a 2-block identity net (no torch op)" if forward == "identity" else "tiny GPT-2"
    work = (f"{invokes} invokes each saving block 0's output of its row (raw, hooks and prototype: "
            f"the {invokes}-row batch)" if invokes else "save block 0's output")
    print(f"per trace (callgrind{', caches simulated' if cache else ''}), {shape}, {work}, "
          f"{traces} warm traces; one mark costs {per_mark[0]:,.0f} instructions (subtracted)\n")
    columns = ["instructions"] + (["L1 misses", "L2 misses"] if cache else [])
    print("| step | calls per trace | " + " | ".join(columns) + " | over the raw forward |")
    print("|---|---:|" + "---:|" * len(columns) + "---:|")
    for label, n, value, over in rows:
        shown = value[:len(columns)]
        extra = "" if over is None else " / ".join(f"{x:+,.0f}" for x in over[:len(columns)])
        print(f"| {label} | {n:g} | " + " | ".join(f"{x:,.0f}" for x in shown) + f" | {extra} |")


def footprint_table(whole, forward, traces):
    shape = "a 2-block identity net (no torch op)" if forward == "identity" else "tiny GPT-2"
    raw = whole["raw forward"]
    print(f"distinct cache lines per call (callgrind, caches simulated and flushed before each "
          f"call), {shape}, save block 0's output, {traces} warm calls\n")
    print("| call | lines touched | over the raw forward | instructions |")
    print("|---|---:|---:|---:|")
    for name, value in whole.items():
        extra = "" if name == "raw forward" else f"{value[2] - raw[2]:+,.0f}"
        print(f"| {name} | {value[2]:,.0f} | {extra} | {value[0]:,.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=10)
    parser.add_argument("--forward", choices=("gpt2", "identity"), default="gpt2",
                        help="the model traced: tiny GPT-2, or a net whose forward runs no torch "
                             "op (its whole-trace count is stable to a few hundred instructions)")
    parser.add_argument("--cache", action="store_true",
                        help="simulate this machine's L1 and L2 caches: add each step's misses")
    parser.add_argument("--footprint", action="store_true",
                        help="with --cache's simulation, flush the caches before each call: its "
                             "L2 misses are then the distinct lines it touches (whole calls only)")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep callgrind's dumps in DIR (for callgrind_annotate: with "
                             "--footprint, cg.out.N is the Nth row's calls, in the table's order)")
    parser.add_argument("--invokes", type=int, default=0, metavar="N",
                        help="count a trace of N invokes, each saving block 0's output of its row "
                             "(the raw forward, plain hooks and the prototype on the N-row batch)")
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.invokes and (args.forward != "gpt2" or args.footprint):
        parser.error("--invokes counts tiny GPT-2's steps (no --forward identity, no --footprint)")
    if args.inside:
        inside(args.inside, args.traces, args.forward, args.footprint, args.invokes)
        return
    folder = args.keep or tempfile.mkdtemp(prefix="interlace-steps-")
    os.makedirs(folder, exist_ok=True)
    try:
        library, why = build_helper(folder)
        if library is None:
            print(f"steps.py needs callgrind: {why}")
            return
        cache = args.cache or args.footprint
        command = ["valgrind", "--tool=callgrind", *(cache_options() if cache else []),
                   "--instr-atstart=no", "--collect-atstart=no",
                   f"--callgrind-out-file={os.path.join(folder, 'cg.out')}", sys.executable,
                   os.path.abspath(__file__), "--inside", folder, "--traces", str(args.traces),
                   "--forward", args.forward, *(["--footprint"] if args.footprint else []),
                   "--invokes", str(args.invokes)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:])
            sys.exit(done.returncode)
        table(folder, args.forward, cache, args.invokes)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
