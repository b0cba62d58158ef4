"""`tracer.cache()` against plain torch hooks capturing the same tensors, side by side.

    python benchmarks/probes/cache.py [--rounds 40] [--tokens 32] [--threads 1]
    INTERLACE_NO_EXTENSIONS=1 python benchmarks/probes/cache.py   # the pure-Python twin

Model: GPT-2 small's shape from a `transformers` config (12 layers, n_embd 768, 12 heads,
vocab 50257), random weights, one prompt of `--tokens` tokens, `torch.no_grad()`, one
intra-op thread. Every round runs every case once in a shuffled order; each ratio is the
median of the per-round ratios (case / its reference).

Cases (issue 10's goal in brackets):
  cache_all     `tracer.cache()`: every module's output (the 151 modules that run and the
                root) vs a forward hook on every module keeping `detach().clone()` of each
                tensor of its output - what the cache keeps (a snapshot)        [<= 1.10x]
  vs_no_copy    the same cache vs hooks keeping `detach()` only (the live tensors, as
                nnsight's cache does on CPU): what the snapshots cost. The cache copies a
                tensor once however many modules pass it on unchanged, so it copies less
                than the cloning hooks do
  cache_blocks  `tracer.cache(modules=model.transformer.h)`: the 12 blocks' outputs
                vs the same hooks on the 12 blocks only
The default run takes about a minute on a 2-core VM.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import interlace  # noqa: E402 - after the sys.path line that finds src/


def build():
    transformers.logging.set_verbosity_error()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    return GPT2LMHeadModel(config).eval()


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        items = [_snapshot(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, dict):
        out = {k: _snapshot(v) for k, v in value.items()}
        return out if type(value) is dict else type(value)(**out)
    return value


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        items = [_detached(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        out = {k: _detached(v) for k, v in value.items()}
        return out if type(value) is dict else type(value)(**out)
    return value


def plain_cache(module, subs, keep=_snapshot):
    """Plain hooks: {path: keep(output)} for `subs` ({path: submodule})."""
    out = {}

    def hook_for(path):
        def hook(mod, args, output):
            out[path] = keep(output)

        return hook

    handles = [sub.register_forward_hook(hook_for(path)) for path, sub in subs.items()]
    return out, handles


def cases(gpt2, tokens):
    model = interlace.Model(gpt2)
    ids = torch.randint(0, 50257, (1, tokens), generator=torch.Generator().manual_seed(0))
    every = {("model." + name if name else "model"): sub for name, sub in gpt2.named_modules()}
    blocks = {f"model.transformer.h.{i}": b for i, b in enumerate(gpt2.transformer.h)}

    def cache_all():
        with model.trace(ids) as tracer:
            cache = tracer.cache()
        return cache

    def cache_blocks():
        with model.trace(ids) as tracer:
            cache = tracer.cache(modules=model.transformer.h)
        return cache

    def reference(subs, keep=_snapshot):
        def run():
            out, handles = plain_cache(gpt2, subs, keep)
            try:
                gpt2(ids)
            finally:
                for handle in handles:
                    handle.remove()
            return out

        return run

    # sanity: the cache holds what the plain hooks hold, bit for bit
    with torch.no_grad():
        got, want = cache_all(), reference(every)()
        called = list(want)  # in the order the modules finished
        assert list(got) == called, "the cache's modules differ from the hooks'"
        for path in called:
            a, b = got[path].output, want[path]
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b), path
    return {
        "cache_all": (cache_all, reference(every)),
        "vs_no_copy": (cache_all, reference(every, _detached)),
        "cache_blocks": (cache_blocks, reference(blocks)),
    }, len(called)


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
            "median_ms": statistics.median(case) / 1e6,
            "ref_median_ms": statistics.median(ref) / 1e6,
            "ratio": statistics.median([c / r for c, r in zip(case, ref)]),
            "ratio_of_mins": min(case) / min(ref),
        }
    return report


GOALS = {"cache_all": 1.10}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pairs, nmodules = cases(build(), args.tokens)
    report = measure(pairs, args.rounds, args.warmup)
    path = "native (compiled hot path)" if interlace.native else "pure-Python twin"
    print(f"interlace {interlace.__version__}, {path}, python {sys.version.split()[0]}, "
          f"torch {torch.__version__}, {args.rounds} rounds, {args.tokens} tokens, "
          f"{nmodules} modules cached by cache_all")
    print(f"{'case':13s} {'interlace ms':>13s} {'hooks ms':>9s} {'ratio':>7s} {'min/min':>8s}  goal")
    for name, row in report.items():
        goal = GOALS.get(name)
        print(f"{name:13s} {row['median_ms']:13.2f} {row['ref_median_ms']:9.2f} "
              f"{row['ratio']:7.3f} {row['ratio_of_mins']:8.3f}  "
              f"{'<= %.2fx' % goal if goal else ''}")


if __name__ == "__main__":
    main()
