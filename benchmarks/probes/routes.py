"""A body on a greenlet against the same body as a generator, in paired rounds.

    python benchmarks/probes/routes.py                 # ~1 min: 2x2 Linear, tiny GPT-2, a sweep
    python benchmarks/probes/routes.py --rounds 3000   # steadier

Every body that capture proves may run as a generator (docs/architecture.md, "Generator
bodies"); this times the same warm call site both ways in one process, by setting the
site's route before each call (a round runs both, in a shuffled order), and reports the
medians and the median of the per-round differences:

  linear   a 2x2 Linear, `save(model.output)` (the harness's `fixed`)
  tiny     tiny GPT-2 (2 layers, n_embd 64, 16 tokens), save block 0's and 1's outputs
  sweep    the harness's `sweep_item` probe: every (layer, position) patched x8, batch 64,
           per item (`--sweep-rounds`, fewer: each is 256 items)

`--evict` reads an 8 MB buffer before each call (caches cold, as after a forward of a
larger model). One torch thread. The harness's before/after cannot show a few µs on a busy
VM; paired rounds in one process can.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

if not __package__:  # run as a script: this checkout's src/ and the probes beside it
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "src"))
    sys.path.insert(0, here)

import interlace  # noqa: E402
from interlace import save  # noqa: E402
from interlace.intervention import routes  # noqa: E402

import sweep as S  # noqa: E402 - the sweep probe's pieces (benchmarks/probes/sweep.py)

GREENLET = "on a greenlet (set by probes/routes.py)"


def _blocks_of(code):
    """The Blocks of the `with` sites in `code` that have run (to set their route)."""
    from interlace.tracing.blocks import BLOCKS

    return [block for key, (held, block) in BLOCKS.items()
            if held is code and hasattr(block, "route")]


def paired(cases, rounds, evict):
    """{case: (generator us, greenlet us, median per-round difference us)}."""
    buffer = bytearray(8 * 1024 * 1024) if evict else None
    times = {(name, route): [] for name in cases for route in (routes.GENERATOR, GREENLET)}
    sites = {}
    for name, (fn, per, code) in cases.items():
        for _ in range(3):  # the audit, then warm
            fn()
        sites[name] = _blocks_of(code)
        if not sites[name] or any(block.route is not routes.GENERATOR for block in sites[name]):
            raise SystemExit(f"{name}: the site does not run as a generator here "
                             f"({[block.route for block in sites[name]]})")
    order = [(name, route) for name in cases for route in (routes.GENERATOR, GREENLET)]
    for _ in range(rounds):
        random.shuffle(order)
        for name, route in order:
            fn, per, _ = cases[name]
            for block in sites[name]:
                block.route = route
            if buffer is not None:
                buffer[::4096] = bytes(len(buffer[::4096]))
            start = time.perf_counter()
            fn()
            times[(name, route)].append((time.perf_counter() - start) / per * 1e6)
    for blocks in sites.values():
        for block in blocks:
            block.route = routes.GENERATOR
    out = {}
    for name in cases:
        gen, green = times[(name, routes.GENERATOR)], times[(name, GREENLET)]
        out[name] = (statistics.median(gen), statistics.median(green),
                     statistics.median(a - b for a, b in zip(gen, green)))
    return out


def cases():
    """{name: (call, calls per call, the code whose `with` it runs)}."""
    torch.manual_seed(0)
    linear = interlace.Model(torch.nn.Linear(2, 2))
    x = torch.ones(1, 2)

    def fixed():
        with linear.trace(x):
            h = save(linear.output)
        return h

    gpt2 = S.build("tiny", "cpu", torch.float32)
    tiny = interlace.Model(gpt2)
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))

    def two_reads():
        with torch.no_grad(), tiny.trace(ids):
            a = tiny.transformer.h[0].output.save()
            b = tiny.transformer.h[1].output.save()
        return a, b

    corrupt = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        clean = []
        hooks = [block.register_forward_hook(lambda m, a, o: clean.append(o.clone()))
                 for block in gpt2.transformer.h]
        gpt2(ids)
        for hook in hooks:
            hook.remove()
    cells = [(layer, pos) for layer in range(2) for pos in range(16)] * 8
    blocks, head = tiny.transformer.h, tiny.lm_head

    def patching():
        return S.patch_sweep(tiny, blocks, head, cells, corrupt, clean, 64)

    return {"linear": (fixed, 1, fixed.__code__), "tiny": (two_reads, 1, two_reads.__code__),
            "sweep": (patching, len(cells), S.patch_sweep.__code__)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--sweep-rounds", type=int, default=30)
    parser.add_argument("--evict", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    routes.ENABLED = True  # (off by default: this probe is what measures it)
    every = cases()
    sweep = {"sweep": every.pop("sweep")}
    results = paired(every, args.rounds, args.evict)
    results.update(paired(sweep, args.sweep_rounds, args.evict))
    print(f"interlace {'native' if interlace.native else 'twin'}, one torch thread, "
          f"{args.rounds} paired rounds ({args.sweep_rounds} for the sweep){', caches evicted' if args.evict else ''}")
    print()
    print("| case | as a generator (us) | on a greenlet (us) | generator - greenlet, per round (us) |")
    print("|---|---:|---:|---:|")
    for name, (gen, green, diff) in results.items():
        unit = " per item" if name == "sweep" else ""
        print(f"| {name}{unit} | {gen:,.1f} | {green:,.1f} | {diff:+.1f} |")


if __name__ == "__main__":
    main()
