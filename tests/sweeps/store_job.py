"""A sweep with `save_to=` run in a subprocess by tests/sweeps/test_store.py (SIGKILLed mid-run,
then resumed in the test's process): `STORE_JOB_LOG=LOG STORE_JOB_KILL_AT=K python store_job.py
FOLDER`.

Every item's body appends its index to LOG (so the test sees which bodies ran); the body of
item K kills the process with SIGKILL (the batch in flight is lost).
"""

import os
import signal
import sys

import torch

N_ITEMS = 40
BATCH = 4


def build():
    """The model and the items (seeded: the same in every process)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import interlace

    torch.manual_seed(0)
    module = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2,
                                        n_head=4, bos_token_id=0, eos_token_id=0)).eval()
    ids = torch.randint(0, 1000, (N_ITEMS, 8), generator=torch.Generator().manual_seed(3))
    return interlace.Model(module), module, ids


def mark(index):
    """Log that item `index`'s body ran; kill the process at the item named in the env."""
    with open(os.environ["STORE_JOB_LOG"], "a") as log:
        log.write(f"{index}\n")
    if str(index) == os.environ.get("STORE_JOB_KILL_AT"):
        os.kill(os.getpid(), signal.SIGKILL)


def sweep(model, ids, folder):
    with torch.no_grad(), model.sweep(range(len(ids)), input=lambda i: ids[i:i + 1],
                                      batch_size=BATCH, save_to=folder, progress=False) as sweep:
        mark(sweep.index)
        hidden = model.transformer.h[0].output.save()
        logits = model.lm_head.output[:, -1].save()
    return hidden, logits


if __name__ == "__main__":
    model, _, ids = build()
    sweep(model, ids, sys.argv[1])
