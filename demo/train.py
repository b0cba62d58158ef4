"""Train (or reuse) the demo's tiny GPT-2 and its tokenizer, cached under demo_cache/.

Everything is seeded and the step count is fixed, so a given setting always trains the same
model; the cache folder is named after the settings, so changing one retrains instead of
silently reusing a stale model.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .corpus import Fact, make_facts, sentences

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Settings:
    """Everything that decides the trained model. Measured recall with these settings: 200
    steps 37%, 300 steps 100% (seeds 0, 1), 400 steps 100% (seeds 0, 2): 400 leaves a margin."""

    n_countries: int = 100
    seed: int = 0
    vocab_size: int = 500
    n_layer: int = 6
    n_embd: int = 128
    n_head: int = 4
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 50

    def key(self) -> str:
        """Short stable name for the cache folder of a model trained with these settings."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"capitals-{hashlib.sha1(blob).hexdigest()[:10]}"


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) trained on `texts`, wrapped for transformers.

    The vocabulary is kept small on purpose, so the invented names split into several
    pieces, as real names do in a real model's tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
    )


def build_model(tokenizer, s: Settings):
    """GPT2LMHeadModel from a config: GPT-2's architecture at a size CPUs train in a minute."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=32,
        n_embd=s.n_embd,
        n_layer=s.n_layer,
        n_head=s.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def _batch(tokenizer, texts: list[str]):
    """Right-padded batch with labels that ignore the padding."""
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    labels = enc["input_ids"].clone()
    labels[enc["attention_mask"] == 0] = -100
    return enc["input_ids"], enc["attention_mask"], labels


def train(model, tokenizer, texts: list[str], s: Settings, progress: bool = True) -> list[float]:
    """Plain language-model training on the corpus; returns the loss per step."""
    import torch
    from tqdm.auto import tqdm

    ids, mask, labels = _batch(tokenizer, texts)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay,
                            betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < s.warmup:
            return (step + 1) / s.warmup
        t = (step - s.warmup) / max(1, s.steps - s.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(s.seed)
    losses = []
    model.train()
    bar = tqdm(range(s.steps), desc="training", unit="step", disable=not progress,
               dynamic_ncols=True, mininterval=0.5)
    for step in bar:
        rows = torch.randint(0, len(texts), (s.batch_size,), generator=gen)
        logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[rows][:, 1:].flatten(), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def recall(model, tokenizer, facts: list[Fact]) -> list[bool]:
    """Whether greedy decoding of each fact's prompt produces its capital, token for token.

    Computed teacher-forced, one forward per fact: greedy decoding reproduces the answer
    exactly when the argmax at every answer position is the answer's next token.
    """
    import torch

    hits = []
    with torch.no_grad():
        for f in facts:
            prompt = tokenizer(f.prompt)["input_ids"]
            answer = tokenizer(" " + f.capital)["input_ids"]
            ids = torch.tensor([prompt + answer])
            pred = model(input_ids=ids).logits[0].argmax(-1)
            n = len(prompt)
            hits.append(pred[n - 1:n - 1 + len(answer)].tolist() == answer)
    return hits


def load_or_train(cache_root: Path, s: Settings = Settings(), retrain: bool = False,
                  log=print, progress: bool = True) -> tuple[Path, dict]:
    """Path of the trained model folder (model, tokenizer, facts.json, train.json)."""
    folder = Path(cache_root) / s.key()
    if (folder / "train.json").exists() and not retrain:
        info = json.loads((folder / "train.json").read_text())
        log(f"Reusing the model cached in {folder} (delete it, or pass --retrain, to train again).")
        return folder, info

    import torch

    # One thread: the matrices are tiny, and on a busy 2-core machine two spinning OpenMP
    # threads made training 5-7x slower (measured), while one thread loses ~1.7x at most.
    torch.set_num_threads(1)
    seed_everything(s.seed)
    facts = make_facts(s.n_countries, s.seed)
    texts = sentences(facts)
    log(f"Training a tiny GPT-2 ({s.n_layer} layers, d={s.n_embd}) on {len(texts)} sentences "
        f"about {len(facts)} invented countries, e.g. {texts[0]!r}")
    tokenizer = train_tokenizer(texts, s.vocab_size)
    model = build_model(tokenizer, s)
    t0 = time.perf_counter()
    losses = train(model, tokenizer, texts, s, progress=progress)
    seconds = time.perf_counter() - t0
    hits = recall(model, tokenizer, facts)
    info = {
        "settings": asdict(s),
        "train_seconds": round(seconds, 1),
        "final_loss": round(sum(losses[-20:]) / 20, 4),
        "recall_accuracy": sum(hits) / len(hits),
        "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "facts.json").write_text(json.dumps([asdict(f) for f in facts], indent=1))
    (tmp / "train.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    log(f"Trained in {seconds:.0f} s; saved to {folder}")
    return folder, info


def load_facts(folder: Path) -> list[Fact]:
    """The facts a cached model was trained on (facts.json next to its weights)."""
    return [Fact(**d) for d in json.loads((Path(folder) / "facts.json").read_text())]
