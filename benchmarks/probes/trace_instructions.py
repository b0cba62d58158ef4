"""Instructions per warm trace, per contender, as medians over several memory layouts.

    python benchmarks/probes/trace_instructions.py                     # save_one, tiny GPT-2
    python benchmarks/probes/trace_instructions.py --work zero_mlps --layouts 6
    python benchmarks/probes/trace_instructions.py --contenders hooks,interlace --tree DIR

Issue 21 asks for fewer instructions per trace than plain hooks. One callgrind count of one
process cannot settle that: the same code counted in processes whose memory differs only by
where earlier objects landed moves by +-20k instructions a trace on tiny GPT-2 (the whole gap
being measured is of that size). Two of CPython's caches do it, each exact but sensitive to
addresses: the type attribute cache (4,096 slots indexed by a type's version tag and the
attribute name's address: about 120 of a forward's 3,000 lookups miss, each a walk of the
class's MRO of about 300 instructions, and which ones collide depends on both); and the small
object allocator, whose size class with every pool exactly full when a forward starts takes a
fresh pool for each temporary (seen: 140 a trace, 13k instructions).

The first of those can be priced out exactly: CPython walks a class's MRO (`find_name_in_mro`)
only when its type attribute cache misses, so that function's inclusive cost is what the misses
cost. The table gives it per trace ("misses"), and each contender's median with it taken out
("less misses"): what is left moves far less with the layout, and it is what a contender's own
work costs. (Which lookups miss, in one layout: in the one counted for the fourteenth round,
two of the model's own, `GPT2Config.__getattribute__` and `GPT2Model.__getattr__`, shared a
slot and evicted each other 18 times a trace, about 14k instructions; in another layout other
pairs collide. A contender's own lookups add to the slots taken, so it pays some misses on
average: about 1 in 12 of a trace's new (type, name) pairs lands on a slot the forward uses.)

So each contender is counted in `--layouts` processes, each shifted before anything is
imported by a different number of types given version tags and of small objects kept alive
(layout 0: none), with the cyclic collector off (and its threshold out of reach) around the
marked traces; the table gives the median and the range per contender, and the median over
the raw forward and over plain hooks. A layout is the same for every contender, so the
columns compare like with like.
Needs valgrind and a C compiler (`steps.py`'s helper); says so and exits 0 without them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONTENDERS = {  # name: (module, class)
    "raw": ("benchmarks.contenders", "Raw"),
    "hooks": ("benchmarks.contenders", "Hooks"),
    "prototype": ("benchmarks.prototype", "Prototype"),
    "genproto": ("benchmarks.prototype", "GeneratorPrototype"),
    "gencore": ("benchmarks.prototype", "GeneratorCore"),
    "interlace": ("benchmarks.contenders", "Interlace"),
}


def shift_layout(layout):
    """Move what later gets which version tag and address: `layout` x 7 classes looked up
    (each takes the next version tag) and layout x 13 small bytes objects kept alive."""
    kept = [type(f"_Layout{i}", (), {}) for i in range(layout * 7)]
    for cls in kept:
        getattr(cls, "x", None)
    kept += [bytes(37 * i % 500) for i in range(layout * 13)]
    return kept


def inside(folder, contender, work, shape, traces, layout):
    kept = shift_layout(layout)  # (before torch and the model are imported and built)
    import ctypes
    import gc
    import importlib

    sys.path.insert(1, ROOT)
    import torch

    from benchmarks import subjects

    torch.set_num_threads(1)
    module, name = CONTENDERS[contender]
    run = getattr(getattr(importlib.import_module(module), name)(), work)(subjects.build(shape))
    if run is None:
        sys.exit(3)  # the contender has no such workload
    marks = ctypes.CDLL(os.path.join(folder, "libmarks.so"))
    for _ in range(10):
        run()
    gc.collect()
    gc.disable()
    # (and its threshold out of reach: with the collector off, the young generation's count
    # still grows by what each trace leaves tracked, and past the threshold (700) every
    # allocation of a tracked object takes a longer branch, about 3 instructions more, 5k a
    # trace on tiny GPT-2: counts would depend on how many traces ran before)
    thresholds = gc.get_threshold()
    gc.set_threshold(1 << 30)
    marks.il_start()
    for _ in range(traces):
        run()
    marks.il_stop()
    gc.set_threshold(*thresholds)
    gc.enable()
    del kept


def count(contender, work, shape, traces, layout, tree):
    """Instructions per trace of one contender in one layout (None: no such workload)."""
    sys.path.insert(0, HERE)
    from steps import build_helper, dumps

    folder = tempfile.mkdtemp(prefix="interlace-trace-instructions-")
    try:
        library, why = build_helper(folder)
        if library is None:
            raise SystemExit(f"trace_instructions: {why}; nothing counted")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                   f"--callgrind-out-file={os.path.join(folder, 'cg.out')}", sys.executable,
                   os.path.abspath(__file__), "--inside", folder, "--contenders", contender,
                   "--work", work, "--shape", shape, "--traces", str(traces),
                   "--layouts", str(layout)]
        # benchmarks/__init__.py puts INTERLACE_BENCH_SRC first on sys.path (the tree's src/)
        env = {**os.environ, "INTERLACE_BENCH_SRC": os.path.join(tree, "src"), "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode == 3:
            return None
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        return dumps(folder)[-1][0] / traces, miss_cost(folder) / traces
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def miss_cost(folder):
    """Instructions the type attribute cache's misses cost in the last dump: the inclusive
    cost of `find_name_in_mro`, which runs only on a miss (0 when callgrind_annotate is
    missing or the interpreter names it otherwise)."""
    names = sorted((n for n in os.listdir(folder) if n.startswith("cg.out.")),
                   key=lambda n: int(n.rsplit(".", 1)[1]))
    annotate = shutil.which("callgrind_annotate")
    if not names or annotate is None:
        return 0
    done = subprocess.run([annotate, "--inclusive=yes", "--threshold=100", "--auto=no",
                           os.path.join(folder, names[-1])], capture_output=True, text=True)
    return mro_walks(done.stdout)


def mro_walks(annotated):
    """The inclusive instructions of `find_name_in_mro` in callgrind_annotate's output."""
    total = 0
    for line in annotated.splitlines():
        # "  2,592,761 ( 1.15%)  .../typeobject.c:find_name_in_mro [lib]" (and its inlined
        # parts, named by the header they come from)
        found = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+\S*:find_name_in_mro(\s|$)", line)
        if found:
            total += int(found.group(1).replace(",", ""))
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contenders", default="raw,hooks,gencore,interlace",
                        help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--work", default="save_one", help="a harness workload (save_one, zero_mlps, fixed)")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--traces", type=int, default=40, help="marked traces per process")
    parser.add_argument("--layouts", type=int, default=6, help="processes per contender")
    parser.add_argument("--tree", default=ROOT, help="the checkout whose interlace is counted")
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args.inside, args.contenders, args.work, args.shape, args.traces, args.layouts)
        return
    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDERS)}")
    results = {}
    for name in names:
        counts = [count(name, args.work, args.shape, args.traces, layout, os.path.abspath(args.tree))
                  for layout in range(args.layouts)]
        if None not in counts:
            results[name] = counts
    print(f"{args.work}, {args.shape}: instructions per trace, {args.layouts} layouts x "
          f"{args.traces} traces")
    print("| contender | median | lowest | highest | misses | less misses | over raw | over hooks |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    medians = {name: statistics.median(c for c, _ in counts) for name, counts in results.items()}
    less = {name: statistics.median(c - m for c, m in counts) for name, counts in results.items()}
    for name, counts in results.items():
        totals = [c for c, _ in counts]
        over = [f"{medians[name] - medians[base]:+,.0f} ({less[name] - less[base]:+,.0f})"
                if base in medians else "" for base in ("raw", "hooks")]
        print(f"| {name} | {medians[name]:,.0f} | {min(totals):,.0f} | {max(totals):,.0f} | "
              f"{statistics.median(m for _, m in counts):,.0f} | {less[name]:,.0f} | "
              f"{over[0]} | {over[1]} |")
    print("(over raw, over hooks: medians, and in brackets with the misses taken out)")


if __name__ == "__main__":
    main()
