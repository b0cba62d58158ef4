"""Interleaving overhead against plain torch hooks, measured side by side in one run.

    python benchmarks/bench_interleave.py [--rounds 1000] [--threads 1]
    INTERLACE_NO_EXTENSIONS=1 python benchmarks/bench_interleave.py   # the pure-Python twin

Model: GPT-2 from a `transformers` config (2 layers, n_embd 64, 4 heads, vocab 1000), random
weights, 16 tokens, `torch.no_grad()`, one intra-op thread. Every round runs every case once,
in a shuffled order, so that a noisy machine slows all cases alike; each figure is the median
over rounds, and each ratio is the median of the per-round ratios (case / its reference).

Cases (issue 3's goals in brackets; nnsight 0.8.1 measured 1.20x, 1.25x, 1.24x, ~280 us):
  save_one   trace saving layer 0's output   vs one register_forward_hook cloning it   [<=1.05x]
  zero_mlps  zero every MLP output, save logits vs the same edit by plain hooks        [<=1.10x]
  save_all   save every layer's output       vs a cloning hook on every layer          [<=1.10x]
  wrapped    Model(gpt2)(ids) outside traces vs gpt2(ids)                              [<=1.01x]
  fixed      per-trace fixed cost: save_one minus its reference, and the same on a 2x2 Linear
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import interlace  # noqa: E402


def build():
    transformers.logging.set_verbosity_error()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def cases(gpt2):
    model = interlace.Model(gpt2)
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    blocks = list(gpt2.transformer.h)
    lin = torch.nn.Linear(2, 2)
    tiny = interlace.Model(lin)
    x = torch.randn(1, 2)

    def save_one():
        with model.trace(ids):
            h = model.transformer.h[0].output.save()
        return h

    def save_one_ref():
        out = {}
        handle = blocks[0].register_forward_hook(lambda m, a, o: out.__setitem__("h", o.clone()))
        try:
            gpt2(ids)
        finally:
            handle.remove()
        return out["h"]

    def zero_mlps():
        with model.trace(ids):
            for block in model.transformer.h:
                block.mlp.output = torch.zeros_like(block.mlp.output)
            logits = model.lm_head.output.save()
        return logits

    def zero_mlps_ref():
        out = {}
        handles = [b.mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o)) for b in blocks]
        handles.append(gpt2.lm_head.register_forward_hook(lambda m, a, o: out.__setitem__("l", o)))
        try:
            gpt2(ids)
        finally:
            for handle in handles:
                handle.remove()
        return out["l"]

    def save_all():
        with model.trace(ids):
            hs = interlace.save([block.output for block in model.transformer.h])
        return hs

    def save_all_ref():
        out = []
        handles = [b.register_forward_hook(lambda m, a, o: out.append(o.clone())) for b in blocks]
        try:
            gpt2(ids)
        finally:
            for handle in handles:
                handle.remove()
        return out

    def wrapped():
        return model(ids)

    def wrapped_ref():
        return gpt2(ids)

    def tiny_trace():
        with tiny.trace(x):
            h = tiny.output.save()
        return h

    def tiny_ref():
        out = {}
        handle = lin.register_forward_hook(lambda m, a, o: out.__setitem__("h", o.clone()))
        try:
            lin(x)
        finally:
            handle.remove()
        return out["h"]

    # sanity: each case computes what its reference computes
    with torch.no_grad():
        assert torch.equal(save_one(), save_one_ref())
        assert torch.equal(zero_mlps(), zero_mlps_ref())
        assert all(torch.equal(a, b) for a, b in zip(save_all(), save_all_ref()))
        assert torch.equal(tiny_trace(), tiny_ref())
    return {
        "save_one": (save_one, save_one_ref),
        "zero_mlps": (zero_mlps, zero_mlps_ref),
        "save_all": (save_all, save_all_ref),
        "wrapped": (wrapped, wrapped_ref),
        "tiny": (tiny_trace, tiny_ref),
    }


def measure(pairs, rounds, warmup):
    timer = time.perf_counter_ns
    fns = [(name, side, fn) for name, pair in pairs.items() for side, fn in zip((0, 1), pair)]
    times = {(name, side): [] for name, side, _ in fns}
    with torch.no_grad():
        for _ in range(warmup):
            for _, _, fn in fns:
                fn()
        for _ in range(rounds):
            random.shuffle(fns)
            for name, side, fn in fns:
                start = timer()
                fn()
                times[(name, side)].append(timer() - start)
    report = {}
    for name in pairs:
        case, ref = times[(name, 0)], times[(name, 1)]
        report[name] = {
            "median_us": statistics.median(case) / 1e3,
            "ref_median_us": statistics.median(ref) / 1e3,
            "ratio": statistics.median([c / r for c, r in zip(case, ref)]),
            "ratio_of_medians": statistics.median(case) / statistics.median(ref),
            "ratio_of_mins": min(case) / min(ref),
            "overhead_us": statistics.median([c - r for c, r in zip(case, ref)]) / 1e3,
        }
    return report


GOALS = {"save_one": 1.05, "zero_mlps": 1.10, "save_all": 1.10, "wrapped": 1.01}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = measure(cases(build()), args.rounds, args.warmup)
    path = "native (compiled hot path)" if interlace._native.hotpath.__name__.endswith(
        "_chotpath") else "pure-Python twin"
    print(f"interlace {interlace.__version__}, {path}, python {sys.version.split()[0]}, "
          f"torch {torch.__version__}, {args.rounds} rounds")
    print(f"{'case':10s} {'interlace us':>13s} {'ref us':>9s} {'ratio':>7s} {'min/min':>8s} "
          f"{'+us':>7s}  goal")
    for name, row in report.items():
        goal = GOALS.get(name)
        print(f"{name:10s} {row['median_us']:13.1f} {row['ref_median_us']:9.1f} "
              f"{row['ratio']:7.3f} {row['ratio_of_mins']:8.3f} {row['overhead_us']:7.1f}  "
              f"{'<= %.2fx' % goal if goal else ''}")
    print(f"per-trace fixed overhead: {report['save_one']['overhead_us']:.1f} us on GPT-2, "
          f"{report['tiny']['overhead_us']:.1f} us on a 2x2 Linear (trace minus hooked forward)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
