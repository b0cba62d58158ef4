"""GPU memory after the user lets go: back to its baseline, without the cyclic collector.

Run: `PYTHONPATH=src python benchmarks/probes/memory.py [--device cuda|cpu] [--layers N]
[--embd N]`. Not part of the test suite (tests/intervention/test_memory.py and
tests/models/test_memory.py check the same cases on CPU with weakrefs). Without a GPU,
`--device cuda` (the default) says so and exits 0; `--device cpu` runs the cases with the
weakref/tensor-count check alone.

For each case: a GPT-2 built from a config (12 layers, n_embd 768 by default: ~0.5 GB of
float32 weights) is moved to the device and wrapped, traced three times, and then every
reference is dropped. With `gc.disable()` and no `gc.collect()`, `torch.cuda.memory_allocated()`
must be back to what it was before the model was built, and weakrefs to the module and the
wrapper must be dead. Cases: one trace (read and edit), two invokes, `LanguageModel.generate`
with `tracer.iter`, backward, an error in the body, a KeyboardInterrupt from a forward hook,
and a trace run as the first work of a worker thread that stays alive. Exit status 1 if any
case holds memory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import sys
import weakref

import torch
import transformers  # noqa: F401  (loaded before interlace mounts `.save` on object)

import interlace

PROMPT = "the capital of france is paris and the capital of italy is"


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([PROMPT] * 10, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1000, n_positions=128, n_embd=args.embd, n_layer=args.layers,
                        n_head=max(1, args.embd // 64), eos_token_id=0, bos_token_id=0,
                        pad_token_id=0)
    return GPT2LMHeadModel(config).eval().to(args.device)


# -- the cases: each traces `model` (a Model or a LanguageModel) and returns what it saved ----

def single(model, ids):
    with model.trace(ids):
        h = model.transformer.h[0].output.save()
        model.transformer.h[1].mlp.output[:] = 0
        logits = model.lm_head.output.save()
    return h, logits


def invokes(model, ids):
    with model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            h = model.transformer.h[0].output[:, -1].save()
        with tracer.invoke(ids[1:]):
            model.transformer.h[0].output[:, -1] = h
            logits = model.lm_head.output.save()
    return h, logits


def generate_iter(model, ids):
    with model.generate(PROMPT, max_new_tokens=4, do_sample=False) as tracer:
        logits = [].save()
        for step in tracer.iter[:4]:
            logits.append(model.lm_head.output[:, -1])
            if step == 2:
                model.transformer.h[0].mlp.output[:] = 0
        out = tracer.result.save()
    return logits, out


def backward(model, ids):
    with model.trace(ids):
        h = model.transformer.h[0].output
        loss = model.lm_head.output.logsumexp(-1).mean()
        with loss.backward():
            g = h.grad.save()
    return (g,)


def error_in_body(model, ids):
    try:
        with model.trace(ids):
            model.transformer.h[0].output.save()
            raise ValueError("boom")
    except ValueError:
        pass
    return ()


def keyboard_interrupt_from_a_hook(model, ids):
    def interrupt(module, args, output):
        raise KeyboardInterrupt()

    handle = model._module.transformer.h[1].register_forward_hook(interrupt)
    try:
        with model.trace(ids):
            model.transformer.h[0].output.save()
            model.lm_head.output.save()
    except KeyboardInterrupt:
        pass
    finally:
        handle.remove()
    return ()


CASES = [single, invokes, generate_iter, backward, error_in_body, keyboard_interrupt_from_a_hook]


def run(case, args, tok):
    """Build, wrap, trace three times, return (weakrefs, allocated bytes while held)."""
    module = build(args)
    if case is generate_iter:
        model = interlace.LanguageModel(module, tokenizer=tok)
    else:
        model = interlace.Model(module)
    ids = torch.randint(0, 1000, (2, 16), device=args.device)
    kept = [case(model, ids) for _ in range(3)]
    held = allocated(args.device)
    refs = [weakref.ref(module), weakref.ref(model)]
    del kept
    return refs, held


def plain_run(args):
    """A forward and backward without interlace: what a new thread creates once (its cuBLAS
    workspace) is made before the baseline is read, and the thread's greenlet pool stays
    empty, so the measured trace is the first one in that thread."""
    module = build(args)
    ids = torch.randint(0, 1000, (2, 16), device=args.device)
    module(ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()


def allocated(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("bench_memory: no CUDA device here; nothing measured (use --device cpu for the "
              "weakref check alone)")
        return 0
    cuda = torch.device(args.device).type == "cuda"
    tok = tokenizer()
    worker = concurrent.futures.ThreadPoolExecutor(1)  # stays alive through the check
    plans = [(case.__name__, case, False) for case in CASES]
    plans.append(("single, in a worker thread", single, True))
    failed = False
    print(f"{'case':<34}{'baseline MiB':>14}{'held MiB':>12}{'after MiB':>12}  freed")
    for name, case, threaded in plans:
        run(case, args, tok)  # warm-up: what torch/transformers create once per process
        if threaded:
            worker.submit(plain_run, args).result()
        gc.collect()
        gc.disable()
        try:
            baseline = allocated(args.device)
            if threaded:
                refs, held = worker.submit(run, case, args, tok).result()
            else:
                refs, held = run(case, args, tok)
            after = allocated(args.device)
            alive = [r() is not None for r in refs]
        finally:
            gc.enable()
        ok = after == baseline and not any(alive)
        failed |= not ok
        sizes = [f"{v / 2 ** 20:.1f}" if cuda else "-" for v in (baseline, held, after)]
        print(f"{name:<34}{sizes[0]:>14}{sizes[1]:>12}{sizes[2]:>12}  "
              f"{'yes' if ok else 'NO (module/wrapper alive: %s)' % alive}")
    worker.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
