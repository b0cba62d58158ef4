"""Generation and LanguageModel tracing: interlace vs the same work with plain hooks.

Run: `PYTHONPATH=src python benchmarks/probes/generate.py [--repeats N]`. Not part of the test
suite. Tiny GPT-2 (2 layers, n_embd 64, 4 heads, vocab 1000), built from a config, random
weights; greedy decoding. Each case is timed `repeats` times (after warm-up), interleaved
with its reference so machine noise hits both; the ratio of medians is reported.

Cases:
- generate 16 tokens, nothing read:    lm.generate(...) saving tracer.result  vs model.generate
- generate 16 tokens, read every step: `for step in tracer.all(): lm_head.output`  vs a plain
                                        forward hook cloning lm_head's output at every call
- generate 16 tokens, edit one step:   zero layer 0's MLP at step 3  vs the same plain hook
- trace one prompt, save logits:       lm.trace(text) vs tokenizer + forward with a plain hook
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import transformers  # noqa: F401  (loaded before interlace mounts `.save` on object)

import interlace
from interlace import LanguageModel

PROMPT = "the capital of france is paris and the capital of italy is"
NEW = 16


def build():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([PROMPT] * 10, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        eos_token_id=0, bos_token_id=0, pad_token_id=0,
                        tie_word_embeddings=False)
    module = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # larger weights: greedy tokens vary and an edit visibly moves them
        for p in module.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return module, tokenizer


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def compare(name, ours, ref, repeats):
    for _ in range(3):
        ours(), ref()
    a, b = [], []
    for _ in range(repeats):  # interleave so that noise hits both
        a += timed(ours, 1)
        b += timed(ref, 1)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{name:<40} interlace {ma * 1e3:8.2f} ms   plain {mb * 1e3:8.2f} ms   "
          f"ratio {ma / mb:5.3f}   (+{(ma - mb) * 1e6:7.0f} us)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least noise)")
    options = parser.parse_args()
    repeats = options.repeats
    torch.set_num_threads(options.threads)
    module, tokenizer = build()
    lm = LanguageModel(module, tokenizer=tokenizer)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    print(f"interlace native={interlace.native}; torch {torch.__version__}; "
          f"{ids.shape[1]} prompt tokens, {NEW} new; median of {repeats}")
    torch.set_grad_enabled(False)

    def plain_generate():
        return module.generate(ids, attention_mask=torch.ones_like(ids), **gen)

    def ours_generate():
        with lm.generate(PROMPT, **gen) as tracer:
            out = tracer.result.save()
        return out

    def plain_read_all():
        seen = []
        handle = module.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
        try:
            plain_generate()
        finally:
            handle.remove()
        return seen

    def ours_read_all():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", interlace.IterationCutShortWarning)
            with lm.generate(PROMPT, **gen) as tracer:
                seen = interlace.save([])
                for step in tracer.all():
                    seen.append(lm.lm_head.output.clone())
        return seen

    def plain_edit():
        calls = [0]

        def hook(m, i, o):
            calls[0] += 1
            return o * 0 if calls[0] == 4 else None

        handle = module.transformer.h[0].mlp.register_forward_hook(hook)
        try:
            return plain_generate()
        finally:
            handle.remove()

    def ours_edit():
        with lm.generate(PROMPT, **gen) as tracer:
            for step in tracer.iter[3]:
                lm.transformer.h[0].mlp.output[:] = 0
            out = tracer.result.save()
        return out

    def plain_trace():
        seen = []
        handle = module.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.clone()))
        try:
            enc = tokenizer(PROMPT, return_tensors="pt")
            module(**enc, position_ids=torch.arange(enc["input_ids"].shape[1])[None])
        finally:
            handle.remove()
        return seen

    def ours_trace():
        with lm.trace(PROMPT):
            logits = lm.lm_head.output.clone().save()
        return logits

    assert len(ours_read_all()) == len(plain_read_all()) == NEW
    assert torch.equal(ours_edit(), plain_edit()) and not torch.equal(ours_edit(), plain_generate())
    assert torch.equal(ours_generate(), plain_generate())
    compare("generate, nothing read", ours_generate, plain_generate, repeats)
    compare("generate, lm_head read at every step", ours_read_all, plain_read_all, repeats)
    compare("generate, MLP zeroed at step 3", ours_edit, plain_edit, repeats)
    compare("trace one prompt, save logits", ours_trace, plain_trace, repeats * 5)


if __name__ == "__main__":
    main()
