"""Instructions per sweep item over the floor, counted with callgrind (not timed).

    python benchmarks/probes/sweep_instructions.py                   # this checkout
    python benchmarks/probes/sweep_instructions.py --tree DIR ...    # other checkouts, built in place
    python benchmarks/probes/sweep_instructions.py --floor           # count the floor too (else 1,028k)

The harness's `sweep_item` workload (issue 20's sweep probe: tiny GPT-2, every (layer, position)
cell patched x8 = 256 items, batches of 64, a logit difference saved) timed on a noisy 2-core VM
moves by more than the changes it should show. Instructions do not: each tree is counted in a
process of its own under `valgrind --tool=callgrind`, one warm sweep between marks (`steps.py`'s
helper), and printed per item, with the floor's (plain hooks hand-batched at 64, `sweep.py`'s
`floor(per_row=True)`) and the `memcpy` share (greenlet's stack copies). A tree given with
`--tree` needs its extension built in place (`python setup.py build_ext --inplace`), as the
harness's `--baseline` export has it under build/baseline-<commit>.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ITEMS = 256
FLOOR = 1_028_155  # instructions per item of the floor (tiny GPT-2, x86-64, torch 2.13 CPU)


def inside(folder, tree, floor):
    import ctypes

    sys.path.insert(0, ROOT)  # this checkout's benchmarks (sweep.py's pieces)
    import torch

    from benchmarks.probes import sweep as P

    assert P.interlace.__file__.startswith(os.path.join(tree, "src")), P.interlace.__file__

    marks = ctypes.CDLL(os.path.join(folder, "libmarks.so"))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    gpt2 = P.build("tiny", device, torch.float32)
    layers, _, _, vocab, tokens = P.SHAPES["tiny"]
    model = P.interlace.Model(gpt2)
    clean_ids, corrupt = P.inputs(vocab, tokens, device)
    with torch.no_grad():
        clean = P.clean_cache(gpt2, gpt2.transformer.h, clean_ids)
    cells = [(layer, pos) for layer in range(layers) for pos in range(tokens)] * 8
    assert len(cells) == ITEMS

    def sweep():
        return P.patch_sweep(model, model.transformer.h, model.lm_head, cells, corrupt, clean, 64)

    def hooks():
        return P.floor(gpt2, gpt2.transformer.h, cells, corrupt, clean, 64, per_row=True)

    for fn in ((hooks, sweep) if floor else (sweep,)):
        fn()  # warm
        marks.il_start()
        fn()
        marks.il_stop()


def memcpy(path):
    """Instructions in libc's memcpy in one dump (greenlet copies stacks with it)."""
    done = subprocess.run(["callgrind_annotate", path], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if "memcpy" in line and "(" in line:
            return int(line.split()[0].replace(",", ""))
    return 0


def count(tree, floor):
    """(floor, sweep, sweep's memcpy) instructions per item for the checkout at `tree`."""
    sys.path.insert(0, HERE)
    from steps import build_helper, dumps

    folder = tempfile.mkdtemp(prefix="interlace-sweep-instructions-")
    try:
        library, why = build_helper(folder)
        if library is None:
            return why
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                   f"--callgrind-out-file={os.path.join(folder, 'cg.out')}", sys.executable,
                   os.path.abspath(__file__), "--inside", folder, "--tree", tree]
        if floor:
            command.append("--floor")
        # benchmarks/__init__.py puts INTERLACE_BENCH_SRC first on sys.path (the tree's src/)
        env = {**os.environ, "INTERLACE_BENCH_SRC": os.path.join(tree, "src")}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            return done.stderr[-3000:]
        counts = [instructions for instructions, _, _ in dumps(folder)]
        hooks = counts[0] / ITEMS if floor else FLOOR
        return hooks, counts[-1] / ITEMS, memcpy(os.path.join(folder, f"cg.out.{len(counts)}")) / ITEMS
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", help="a checkout to count (default: this one)")
    parser.add_argument("--floor", action="store_true", help="count the floor too")
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args.inside, args.tree[0], args.floor)
        return
    print("| tree | instructions per item | over the floor | of which memcpy |")
    print("|---|---:|---:|---:|")
    for tree in args.tree or [ROOT]:
        result = count(os.path.abspath(tree), args.floor)
        if isinstance(result, str):
            print(f"{tree}: {result}")
            continue
        hooks, sweep, copied = result
        print(f"| {tree} | {sweep:,.0f} | {sweep - hooks:+,.0f} | {copied:,.0f} |")


if __name__ == "__main__":
    main()
