"""The two experiments, written against interlace, with a plain-hook twin to check them.

`InterlaceProbe` is the demo: what a user writes with `interlace.LanguageModel`.
`HookProbe` computes the same numbers with raw `register_forward_hook` on the same weights;
the demo runs both and prints how far apart they are, so a wrong read or a patch that lands
in the wrong batch row would show up as a disagreement, not as a plausible-looking heatmap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class InterlaceProbe:
    """The analysis written as an interlace user would write it."""

    name = "interlace"

    def __init__(self, model):
        self.model = model  # an interlace.LanguageModel
        self.n_layer = len(model.transformer.h)

    def lens(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logit lens at the last position: (layer, prompt, vocab) probabilities, and the
        model's own last-position logits (prompt, vocab)."""
        model = self.model
        with model.trace(prompts):
            # decode each block's output as if it were the last one: final norm, unembedding
            probs = [model.lm_head(model.transformer.ln_f(block.output[:, -1])).softmax(-1)
                     for block in model.transformer.h].save()
            logits = model.lm_head.output[:, -1].save()
        return torch.stack(probs), logits

    def patched_all(self, clean: list[str], corrupt: list[str], cells, progress=True):
        """Every cell's patched last-position logits in one sweep: (cell, pair, vocab).

        The clean activations are read once; the sweep runs the patch once per (layer,
        position) cell, batching the cells into a few forward passes.
        """
        model = self.model
        with model.trace(clean):
            clean_h = [block.output for block in model.transformer.h].save()
        with model.sweep(cells, input=corrupt, progress=progress) as sweep:
            layer, pos = sweep.item
            model.transformer.h[layer].output[:, pos, :] = clean_h[layer][:, pos, :]
            patched = model.lm_head.output[:, -1, :].save()
        return torch.stack(patched)

    def patched_logits(self, clean: list[str], corrupt: list[str], layer: int, pos: int):
        """One cell, one trace: last-position logits of `corrupt` with block `layer`'s output
        at `pos` from `clean` (the demo times it against `patched_all`)."""
        model = self.model
        with model.trace() as tracer:
            with tracer.invoke(clean):
                clean_h = model.transformer.h[layer].output[:, pos, :].save()
            with tracer.invoke(corrupt):
                model.transformer.h[layer].output[:, pos, :] = clean_h
                patched = model.lm_head.output[:, -1, :].save()
        return patched


class HookProbe:
    """The same two measurements with plain `torch` forward hooks, as the reference."""

    name = "plain hooks"

    def __init__(self, hf_model, tokenizer):
        self.hf = hf_model
        self.tok = tokenizer
        self.tok.padding_side = "left"  # as interlace pads prompts of different lengths
        self.n_layer = len(hf_model.transformer.h)

    def _inputs(self, prompts):
        """Left-padded batch with position ids that skip the padding."""
        enc = self.tok(list(prompts), return_tensors="pt", padding=True)
        pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                    position_ids=pos)

    @torch.no_grad()
    def lens(self, prompts):
        seen = {}
        handles = [blk.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out))
                   for i, blk in enumerate(self.hf.transformer.h)]
        try:
            logits = self.hf(**self._inputs(prompts)).logits[:, -1, :]
        finally:
            for h in handles:
                h.remove()
        ln_f, lm_head = self.hf.transformer.ln_f, self.hf.lm_head
        probs = [lm_head(ln_f(seen[i][:, -1])).softmax(-1) for i in range(self.n_layer)]
        return torch.stack(probs), logits

    @torch.no_grad()
    def patched_logits(self, clean, corrupt, layer, pos):
        n = len(clean)

        def patch(module, args, out):
            out = out.clone()
            out[n:, pos, :] = out[:n, pos, :]
            return out

        handle = self.hf.transformer.h[layer].register_forward_hook(patch)
        try:
            logits = self.hf(**self._inputs(list(clean) + list(corrupt))).logits
        finally:
            handle.remove()
        return logits[n:, -1, :]


@dataclass
class PatchResult:
    """A sweep's scores, with the raw logits kept so two probes can be compared exactly."""

    recovery: torch.Tensor      # (layer, position): mean share of the clean logit gap restored
    patched: torch.Tensor       # (layer, position, pair, vocab) raw patched logits
    clean_gap: torch.Tensor     # (pair,) logit(clean answer) - logit(corrupt answer), clean run
    corrupt_gap: torch.Tensor   # (pair,) the same in the corrupted run
    seconds: float = 0.0        # how long the patching took


def patching_sweep(probe, clean: list[str], corrupt: list[str], clean_ans: list[int],
                   corrupt_ans: list[int], n_pos: int, progress: bool = True) -> PatchResult:
    """Patch each (layer, position) from clean into corrupt; how much of the answer comes back.

    The score is the usual normalised logit difference: 0 means the patch left the corrupted
    run's answer in place, 1 means it brought the clean answer back as strongly as in the clean
    run.
    """
    from tqdm.auto import tqdm

    ca, xa = torch.tensor(clean_ans), torch.tensor(corrupt_ans)
    rows = torch.arange(len(clean))

    def gap(logits):
        return logits[rows, ca] - logits[rows, xa]

    with torch.no_grad():
        _, clean_logits = probe.lens(clean)
        _, corrupt_logits = probe.lens(corrupt)
    g_clean, g_corrupt = gap(clean_logits), gap(corrupt_logits)
    cells = [(layer, pos) for layer in range(probe.n_layer) for pos in range(n_pos)]
    start = time.perf_counter()
    if hasattr(probe, "patched_all"):  # interlace: one sweep over every cell
        with torch.no_grad():
            flat = probe.patched_all(clean, corrupt, cells, progress=progress)
        patched = flat.view(probe.n_layer, n_pos, len(clean), -1)
    else:  # the reference: one hooked forward per cell
        patched = torch.empty(probe.n_layer, n_pos, len(clean), clean_logits.shape[-1])
        for layer, pos in tqdm(cells, desc=f"patching ({probe.name})", unit="cell",
                               disable=not progress, dynamic_ncols=True, mininterval=0.5):
            with torch.no_grad():
                patched[layer, pos] = probe.patched_logits(clean, corrupt, layer, pos)
    seconds = time.perf_counter() - start

    def pick(idx):
        return patched.gather(-1, idx.view(1, 1, -1, 1).expand(*patched.shape[:3], 1))[..., 0]

    g_patched = pick(ca) - pick(xa)
    recovery = ((g_patched - g_corrupt) / (g_clean - g_corrupt)).mean(-1)
    return PatchResult(recovery, patched, g_clean, g_corrupt, seconds)


def time_one_trace_per_cell(probe, clean, corrupt, n_pos) -> float:
    """Seconds to patch every cell with one trace each (what the sweep replaces)."""
    start = time.perf_counter()
    with torch.no_grad():
        for layer in range(probe.n_layer):
            for pos in range(n_pos):
                probe.patched_logits(clean, corrupt, layer, pos)
    return time.perf_counter() - start


def patching_pairs(lengths: list[int], first_answer: list[int], subject_start: int):
    """Indices (clean, corrupt) of facts to patch between, all prompts of one token length.

    Patching position by position needs the clean and corrupted prompts aligned token for
    token, so every pair comes from one length group: the largest group whose subject spans at
    least two tokens (so "which subject token" is a real question). Each fact is paired with
    the next one in its group whose answer starts with a different token, so the two answers
    can be told apart by their first token's logit.
    """
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    # the prompt ends with one token ("is") after the subject
    usable = {n: g for n, g in groups.items() if n - subject_start - 1 >= 2 and len(g) >= 2}
    if not usable:
        raise ValueError("no two prompts share a token length with a multi-token subject")
    length = max(usable, key=lambda n: (len(usable[n]), -n))
    group = usable[length]
    pairs = []
    for k, i in enumerate(group):
        for shift in range(1, len(group)):
            j = group[(k + shift) % len(group)]
            if first_answer[j] != first_answer[i]:
                pairs.append((i, j))
                break
    return length, pairs
