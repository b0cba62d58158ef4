"""Sweeps: activation patching of every (layer, position), four ways, ratios in one run.

    python benchmarks/probes/sweep.py                         # tiny and 4-layer GPT-2, CPU, ~1 min
    python benchmarks/probes/sweep.py --shapes gpt2-small     # the 12-layer GPT-2-small shape (slow on CPU)
    python benchmarks/probes/sweep.py --device cuda           # bf16 on a GPU, GPT-2-small, 32 tokens
    python benchmarks/probes/sweep.py --dataset --generate    # + 1,000 prompts, + a generation sweep
    python benchmarks/probes/sweep.py --ray                   # + the patching sweep on 2 Ray workers

The four ways of running one patch per (layer, position) -- copy the clean run's block output
at that position into the corrupted run, read a logit difference:

  nnsight   nnsight 0.8.1, one trace per patch (when installed; on its own copy of the model)
  trace     interlace, one trace per patch
  sweep     interlace `model.sweep(cells, input=corrupt)`, automatic batch size
  floor     plain forward hooks, hand-batched at the batch size the sweep chose: one hook per
            patched layer that writes every row's position at once (rows routed per layer)

plus `floor*`, the hand-batched hooks at the best of several batch sizes. Every round runs
every way once, in a shuffled order (a noisy machine slows all alike); each figure is the
median over rounds. Before timing, the sweep's values are checked against the floor's.
Goals (issue 9): CPU, one thread: sweep within 1.2x of floor on every shape and at least 2x
faster than one trace per patch on the 4-layer model; GPU: within 1.3x of floor, 20x faster
than nnsight's loop, 3x faster than nnsight with 32 invokes per trace written by hand.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time

import torch
import transformers

if not __package__:  # run as a script: this checkout's src/ (the harness has put the right one first)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import interlace  # noqa: E402 - after the sys.path line that finds src/

A, B = 5, 7  # the two tokens whose logit difference every way reads
SHAPES = {  # name: (layers, n_embd, heads, vocab, tokens on CPU)
    "tiny": (2, 64, 4, 1000, 16),
    "small4": (4, 256, 4, 50257, 16),
    "gpt2-small": (12, 768, 12, 50257, 16),
}


def build(shape, device, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, embd, heads, vocab, _ = SHAPES[shape]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, vocab_size=vocab,
                        n_positions=128, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval().to(device=device, dtype=dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def inputs(vocab, tokens, device):
    """The clean and the corrupted run's token ids, (1, tokens) each, seeded."""
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    return clean, torch.randint(0, vocab, (1, tokens), generator=g).to(device)


def clean_cache(gpt2, blocks, ids):
    """Every block's output on the clean run (plain hooks: no interlace needed)."""
    out = []
    handles = [block.register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o))
               for block in blocks]
    try:
        gpt2(ids)
    finally:
        for handle in handles:
            handle.remove()
    return out


def patch_sweep(model, blocks, head, cells, corrupt, clean, batch_size=None, **kwargs):
    """interlace's `model.sweep` patching one (layer, position) per item (`blocks`, `head`:
    the model's block list and unembedding, as envoys; `kwargs`: more of sweep's keywords):
    (every item's logit difference, the batch size it ran with)."""
    with torch.no_grad(), model.sweep(cells, input=corrupt, batch_size=batch_size, progress=False,
                                      **kwargs) as sweep:
        layer, pos = sweep.item
        blocks[layer].output[:, pos] = clean[layer][:, pos]
        logits = head.output[:, -1]
        diff = (logits[:, A] - logits[:, B]).save()
    return diff, sweep.chosen_batch_size


def routes(chunk):
    """{layer: [(row, position), ...]}: which rows of a batch of `chunk`'s cells patch each layer."""
    out = {}
    for row, (layer, pos) in enumerate(chunk):
        out.setdefault(layer, []).append((row, pos))
    return out


def write_rows(output, clean, pairs):
    """Patch each (row, position) of `output` from the clean run, one row at a time."""
    for row, pos in pairs:
        output[row, pos] = clean[0, pos]


def floor(gpt2, blocks, cells, corrupt, clean, batch_size, per_row=False):
    """Plain forward hooks, hand-batched at `batch_size`: one hook per patched layer writing
    its rows (at once by indexing; `per_row`: in a Python loop, issue 20's floor), the logit
    difference computed batched. One (rows,) tensor per batch."""
    out = []
    with torch.no_grad():
        for start in range(0, len(cells), batch_size):
            chunk = cells[start:start + batch_size]
            handles = []
            for layer, pairs in routes(chunk).items():
                if per_row:
                    def hook(module, args, output, pairs=pairs, cache=clean[layer]):
                        write_rows(output, cache, pairs)
                else:
                    rows = torch.tensor([row for row, _ in pairs], device=corrupt.device)
                    positions = torch.tensor([pos for _, pos in pairs], device=corrupt.device)

                    def hook(module, args, output, rows=rows, positions=positions, cache=clean[layer]):
                        output[rows, positions] = cache[0, positions]

                handles.append(blocks[layer].register_forward_hook(hook))
            try:
                logits = gpt2(corrupt.expand(len(chunk), -1)).logits[:, -1]
            finally:
                for handle in handles:
                    handle.remove()
            out.append(logits[:, A] - logits[:, B])
    return out


class Patching:
    """The every-(layer, position) patching sweep on one model, written four ways."""

    def __init__(self, gpt2, tokens, device):
        self.gpt2, self.device = gpt2, device
        self.model = interlace.Model(gpt2)
        self.clean_ids, self.corrupt = inputs(gpt2.config.vocab_size, tokens, device)
        layers = gpt2.config.n_layer
        self.cells = [(layer, pos) for layer in range(layers) for pos in range(tokens)]
        with torch.no_grad():
            self.clean = clean_cache(gpt2, gpt2.transformer.h, self.clean_ids)
        self.chosen = None

    def sweep(self, batch_size=None):
        model = self.model
        diff, self.chosen = patch_sweep(model, model.transformer.h, model.lm_head, self.cells, self.corrupt,
                                  self.clean, batch_size)
        return diff

    def trace(self):
        model, clean, out = self.model, self.clean, []
        for layer, pos in self.cells:
            with torch.no_grad(), model.trace(self.corrupt):
                model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
                logits = model.lm_head.output[:, -1]
                diff = (logits[:, A] - logits[:, B]).save()
            out.append(diff)
        return out

    def floor(self, batch_size):
        chunks = floor(self.gpt2, self.gpt2.transformer.h, self.cells, self.corrupt, self.clean, batch_size)
        return [d for chunk in chunks for d in chunk.unbind(0)]

    def nnsight(self):
        import nnsight

        if not hasattr(self, "_nn"):
            self._nn = nnsight.NNsight(copy.deepcopy(self.gpt2))
        model, clean, out = self._nn, self.clean, []
        for layer, pos in self.cells:
            with torch.no_grad(), model.trace(self.corrupt):
                model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
                logits = model.lm_head.output[:, -1]
                diff = nnsight.save(logits[:, A] - logits[:, B])
            out.append(diff)
        return out

    def nnsight_invokes(self, per_trace=32):
        """nnsight with `per_trace` invokes per trace, written by hand (the peers' best; its
        plain-module wrapper refuses invokes, so this one is its LanguageModel)."""
        import warnings

        import nnsight

        if not hasattr(self, "_nn_lm"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._nn_lm = nnsight.LanguageModel(copy.deepcopy(self.gpt2),
                                                    tokenizer=_tokenizer(self.gpt2.config.vocab_size))
        model, clean, out, cells = self._nn_lm, self.clean, [], self.cells
        for start in range(0, len(cells), per_trace):
            with torch.no_grad(), model.trace() as tracer:
                diffs = nnsight.save([])
                for layer, pos in cells[start:start + per_trace]:
                    with tracer.invoke(self.corrupt):
                        model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
                        logits = model.lm_head.output[:, -1]
                        diffs.append(logits[:, A] - logits[:, B])
            out.extend(diffs)
        return out


def _tokenizer(vocab):
    """A word-level tokenizer over the ids (nnsight's LanguageModel insists on one)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, "t0")),
                                   pad_token="t0", eos_token="t0")


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_ms(times):
    return statistics.median(times) * 1e3


def _nnsight_available():
    try:
        from importlib.metadata import version

        return version("nnsight") == "0.8.1"
    except Exception:  # noqa: BLE001 - not installed or not importable: not measured
        return False


def bench_patching(shape, device, dtype, rounds, tokens, tolerance):
    gpt2 = build(shape, device, dtype)
    p = Patching(gpt2, tokens, device)
    values = p.sweep()
    chosen = p.chosen
    floor = p.floor(chosen)
    worst = max(float((a.reshape(-1) - b.reshape(-1)).abs().max()) for a, b in zip(values, floor))
    assert worst <= tolerance, f"sweep and hand-batched hooks disagree by {worst}"
    sizes = sorted({s for s in (8, 16, 32, 64, 128, 256) if s <= len(p.cells)} | {chosen})
    ways = {"sweep": p.sweep, "trace": p.trace, "floor": lambda: p.floor(chosen)}
    ways.update({f"floor@{s}": (lambda s=s: p.floor(s)) for s in sizes if s != chosen})
    if _nnsight_available():
        ways["nnsight"] = p.nnsight
        ways["nnsight-invokes"] = p.nnsight_invokes
    times = {name: [] for name in ways}
    for name, fn in ways.items():
        fn()  # warm up
    for _ in range(rounds):
        order = list(ways)
        random.shuffle(order)
        for name in order:
            times[name].append(timed(ways[name], device))
    ms = {name: median_ms(t) for name, t in times.items()}
    best_size, best = min(((s, ms["floor" if s == chosen else f"floor@{s}"]) for s in sizes),
                          key=lambda x: x[1])
    return dict(shape=shape, cells=len(p.cells), tokens=tokens, chosen=chosen, best_size=best_size,
                ms=ms, best=best, worst_diff=worst)


def report_patching(row):
    ms = row["ms"]
    print(f"\n## patching, {row['shape']}: {row['cells']} cells, {row['tokens']} tokens; "
          f"sweep chose batch {row['chosen']}, best hand-batched size {row['best_size']} "
          f"(sweep vs floor max |diff| {row['worst_diff']:.1e})")
    print("| way | ms | per cell (us) | vs floor |")
    print("|---|---|---|---|")
    for name in ("nnsight", "nnsight-invokes", "trace", "sweep", "floor"):
        if name in ms:
            print(f"| {name} | {ms[name]:.1f} | {ms[name] / row['cells'] * 1e3:.0f} | "
                  f"{ms[name] / ms['floor']:.2f}x |")
    print(f"| floor* (best size {row['best_size']}) | {row['best']:.1f} | "
          f"{row['best'] / row['cells'] * 1e3:.0f} | {row['best'] / ms['floor']:.2f}x |")
    line = (f"sweep / floor = {ms['sweep'] / ms['floor']:.2f}x, sweep / floor* = "
            f"{ms['sweep'] / row['best']:.2f}x, one trace per cell / sweep = "
            f"{ms['trace'] / ms['sweep']:.2f}x")
    if "nnsight" in ms:
        line += (f", nnsight loop / sweep = {ms['nnsight'] / ms['sweep']:.2f}x, nnsight 32 "
                 f"invokes / sweep = {ms['nnsight-invokes'] / ms['sweep']:.2f}x")
    print(line)


def bench_dataset(device, dtype, n=1000):
    """A dataset sweep: n prompts of mixed lengths (4-20 tokens), one steering edit each."""
    gpt2 = build("tiny", device, dtype)
    lm = interlace.LanguageModel(gpt2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (int(torch.randint(4, 21, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    vector = torch.linspace(-1, 1, 64, device=device, dtype=dtype)

    def sweep():
        with torch.no_grad(), lm.sweep(prompts, progress=False) as sweep:
            lm.transformer.h[0].output[:] += vector
            logits = lm.lm_head.output[:, -1].save()
        return logits, sweep.chosen_batch_size

    def traces(count):
        out = []
        for prompt in prompts[:count]:
            with torch.no_grad(), lm.trace([prompt]):
                lm.transformer.h[0].output[:] += vector
                out.append(lm.lm_head.output[:, -1].save())
        return out

    sweep()
    t_sweep = timed(sweep, device)
    _, chosen = sweep()
    t_traces = timed(lambda: traces(200), device) * n / 200
    print(f"\n## dataset sweep: {n} prompts of 4-20 tokens, one steering edit (tiny GPT-2)")
    print(f"sweep: {n / t_sweep:.0f} items/s (batch size {chosen}, grouped by length); one trace "
          f"per prompt: {n / t_traces:.0f} items/s; {t_traces / t_sweep:.1f}x")


def bench_generate(device, dtype, n=64, new=8):
    """A generation sweep: n prompts, `new` tokens each, a steering edit at every step."""
    gpt2 = build("tiny", device, dtype)
    lm = interlace.LanguageModel(gpt2)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 1000, (int(torch.randint(4, 9, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    vector = torch.linspace(-1, 1, 64, device=device, dtype=dtype)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def sweep():
        with torch.no_grad(), lm.sweep(prompts, generate=True, progress=False, **kwargs) as sweep:
            for step in sweep.iter[:new]:  # noqa: B007 - the loop drives the steps
                lm.transformer.h[0].output[:] += vector
            ids = sweep.output.save()
        return ids

    def traces():
        out = []
        for prompt in prompts:
            with torch.no_grad(), lm.generate([prompt], **kwargs) as tracer:
                for step in tracer.iter[:new]:  # noqa: B007 - the loop drives the steps
                    lm.transformer.h[0].output[:] += vector
                out.append(tracer.result.save())
        return out

    sweep()
    t_sweep = timed(sweep, device)
    t_traces = timed(traces, device)
    print(f"\n## generation sweep: {n} prompts of 4-8 tokens, {new} new tokens, steering every "
          f"step (tiny GPT-2)")
    print(f"sweep: {n / t_sweep:.1f} items/s; one generate per prompt: {n / t_traces:.1f} "
          f"items/s; {t_traces / t_sweep:.1f}x")


def bench_ray(device, dtype, rounds):
    import ray

    gpt2 = build("small4", device, dtype)
    p = Patching(gpt2, SHAPES["small4"][4], device)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        def on_ray():
            model = p.model
            return patch_sweep(model, model.transformer.h, model.lm_head, p.cells, p.corrupt, p.clean,
                               executor="ray", workers=2)[0]

        first = timed(on_ray, device)
        remote = [timed(on_ray, device) for _ in range(rounds)]
        local = [timed(p.sweep, device) for _ in range(rounds)]
    finally:
        ray.shutdown()
    print(f"\n## Ray: the small4 patching sweep on 2 local workers ({len(p.cells)} cells)")
    print(f"first sweep (starts the actors): {first * 1e3:.0f} ms; later sweeps "
          f"{median_ms(remote):.0f} ms against the local executor's {median_ms(local):.0f} ms "
          f"({median_ms(remote) / median_ms(local):.2f}x)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--shapes", default=None, help="comma-separated: tiny, small4, gpt2-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="1 on CPU")
    parser.add_argument("--tokens", type=int, default=None, help="16 on CPU, 32 on CUDA")
    parser.add_argument("--dataset", action="store_true")
    parser.add_argument("--generate", action="store_true")
    parser.add_argument("--ray", action="store_true")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    threads = args.threads or (torch.get_num_threads() if cuda else 1)
    torch.set_num_threads(threads)
    shapes = (args.shapes or ("gpt2-small" if cuda else "tiny,small4")).split(",")
    tolerance = 0.1 if dtype != torch.float32 else 1e-4
    print(f"# bench_sweep: {device} {dtype}, {threads} torch thread(s), torch {torch.__version__}, "
          f"transformers {transformers.__version__}, interlace native={interlace.native}, "
          f"{args.rounds} rounds")
    for shape in shapes:
        tokens = args.tokens or (32 if cuda else SHAPES[shape][4])
        report_patching(bench_patching(shape, device, dtype, args.rounds, tokens, tolerance))
    if args.dataset:
        bench_dataset(device, dtype)
    if args.generate:
        bench_generate(device, dtype)
    if args.ray:
        bench_ray(device, dtype, max(2, args.rounds // 2))


if __name__ == "__main__":
    main()
