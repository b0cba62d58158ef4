"""`python -m demo`: train a small GPT-2 on invented facts, then find where it recalls them.

Runs offline from a fresh clone: the corpus is generated, the tokenizer and model trained on
the spot (about a minute on two CPU cores) and cached under demo_cache/.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

# The demo never needs the network: everything it loads it wrote itself.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MIN_ACCURACY = 0.90
WIDTH = 96


def say(text: str = "") -> None:
    """Print `text`, wrapped to WIDTH when it is one long line (tables are left alone)."""
    body = text.strip("\n")
    if "\n" not in body and len(body) > WIDTH:
        text = text.replace(body, textwrap.fill(body, WIDTH))
    print(text)


def main(argv=None) -> int:
    from .train import Settings

    ap = argparse.ArgumentParser(prog="python -m demo", description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default="demo_cache", type=Path,
                    help="where the trained model and the heatmap go (default: demo_cache)")
    ap.add_argument("--retrain", action="store_true", help="train again even if cached")
    ap.add_argument("--steps", type=int, default=Settings.steps,
                    help=f"training steps (default {Settings.steps}; cached per setting)")
    ap.add_argument("--backend", choices=["interlace", "hooks"], default="interlace",
                    help="run the analysis with interlace (default, cross-checked against plain "
                         "hooks) or with plain torch hooks only")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny matrices: see load_or_train in demo/train.py

    from .analysis import HookProbe, InterlaceProbe
    from .train import load_facts, load_or_train, recall

    say("interlace demo: where does a small GPT-2 keep the facts it learned?\n")

    # 1. the model -------------------------------------------------------------------------
    say("== 1. Train (or reuse) the model ==")
    folder, info = load_or_train(args.cache_dir, Settings(steps=args.steps),
                                 retrain=args.retrain, log=say,
                                 progress=not args.no_progress)
    facts = load_facts(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hits = recall(hf, tok, facts)
    acc = sum(hits) / len(hits)
    trained_ok = acc >= MIN_ACCURACY
    say(f"Recall accuracy: {sum(hits)}/{len(hits)} = {acc:.0%} of the prompts "
        f"'{facts[0].prompt.replace(facts[0].country, 'X')}' complete with X's capital, token "
        f"for token ({info['n_parameters'] / 1e6:.2f}M parameters, trained "
        f"{info['settings']['steps']} steps in {info['train_seconds']:.0f} s).")
    if trained_ok:
        say(f"Training worked (>= {MIN_ACCURACY:.0%}).\n")
    else:
        say(f"TRAINING DID NOT WORK: accuracy {acc:.0%} is below {MIN_ACCURACY:.0%}, so the "
            "analysis below describes a model that has not learned the facts; its numbers mean "
            f"little. Train longer: `python -m demo --steps {max(2 * args.steps, Settings.steps)}`.\n")

    # 2. the analysis ----------------------------------------------------------------------
    reference = HookProbe(hf, tok)
    if args.backend == "hooks":
        say("Running with plain torch hooks only (--backend hooks): no interlace involved.\n")
        agree = _analysis(reference, None, facts, tok, args)
    else:
        try:
            import interlace

            model = interlace.LanguageModel(str(folder))
            say(f"Loaded {folder} with interlace.LanguageModel "
                f"(native extension: {'on' if interlace.native else 'off'}).\n")
            agree = _analysis(InterlaceProbe(model), reference, facts, tok, args)
        except Exception:
            print("\nThe interlace analysis failed (traceback below). `python -m demo --backend "
                  "hooks` runs the same analysis with plain torch hooks.\n", file=sys.stderr)
            raise
    if not trained_ok:
        say(f"\nTRAINING DID NOT WORK (recall accuracy {acc:.0%} < {MIN_ACCURACY:.0%}): the "
            "analysis above describes a model that has not learned the facts.")
    say(f"\nDone in {time.perf_counter() - t_start:.0f} s.")
    return 0 if trained_ok and agree else 1


def _analysis(probe, reference, facts, tok, args) -> bool:
    """Logit lens, patching sweep, and (given a reference probe) the cross-check."""
    import torch

    from .analysis import patching_pairs, patching_sweep, time_one_trace_per_cell
    from .corpus import PROMPT
    from .report import format_table, heatmap, shade

    n_layer = probe.n_layer
    progress = not args.no_progress

    def piece(i: int) -> str:
        return repr(tok.decode([i]))

    # logit lens ---------------------------------------------------------------------------
    say("== 2. Logit lens: what each block's output at the last position would predict ==")
    prompts = [f.prompt for f in facts]
    answers = [tok(" " + f.capital)["input_ids"][0] for f in facts]
    with torch.no_grad():
        probs, final_logits = probe.lens(prompts)
    ex, idx, target = 0, torch.arange(len(facts)), torch.tensor(answers)
    rows = []
    for layer in range(n_layer):
        p = probs[layer]
        top_p, top_i = p[ex].topk(3)
        p_ans = p[idx, target]
        rows.append([f"block {layer}",
                     "  ".join(f"{piece(i)} {v:.2f}" for v, i in zip(top_p.tolist(), top_i.tolist())),
                     f"{p_ans[ex].item():.2f}", f"{(p.argmax(-1) == target).float().mean():.0%}",
                     f"{p_ans.mean().item():.2f}"])
    say(f"Example: {facts[ex].prompt!r} -> {facts[ex].capital!r} "
        f"(first answer token {piece(answers[ex])})")
    say(format_table(["layer", "example: top-3 guesses", "p(answer)",
                      f"all {len(facts)}: top-1 ok", "mean p(answer)"], rows, align="lllrr"))
    lens_err = (probs[-1] - final_logits.softmax(-1)).abs().max().item()
    top1 = (probs.argmax(-1) == target).float().mean(-1)
    first = next((layer for layer in range(n_layer) if top1[layer] > 0.5), None)
    if first is not None:
        say(f"The capital's first token is the lens's top guess for most facts from block "
            f"{first} on ({top1[first]:.0%} of them).")
    say(f"(sanity: the last block's lens is the model's own output, max |diff| = {lens_err:.1e})\n")

    # activation patching ------------------------------------------------------------------
    say("== 3. Activation patching: which (block, position) carries the fact? ==")
    subject_start = len(tok(PROMPT.split("{country}")[0].rstrip())["input_ids"])
    lengths = [len(tok(f.prompt)["input_ids"]) for f in facts]
    length, pairs = patching_pairs(lengths, answers, subject_start)
    clean = [facts[i].prompt for i, _ in pairs]
    corrupt = [facts[j].prompt for _, j in pairs]
    clean_ans = [answers[i] for i, _ in pairs]
    corrupt_ans = [answers[j] for _, j in pairs]
    n_subj = length - subject_start - 1
    ex_tokens = [tok.decode([t]).strip() for t in tok(clean[0])["input_ids"]]
    labels = (ex_tokens[:subject_start] + [f"subj{k + 1}" for k in range(n_subj)]
              + [ex_tokens[-1]])
    subj_example = "|".join(ex_tokens[subject_start:-1])
    say(f"{len(pairs)} pairs of prompts with {n_subj}-token countries, e.g. clean {clean[0]!r} "
        f"vs corrupted {corrupt[0]!r}; subj1..subj{n_subj} are the country's tokens "
        f"({subj_example}). In each cell, that block's output at that position is copied from "
        "the clean run into the corrupted one; the score is how much of the "
        "clean answer comes back (0 = none, 1 = all of it). interlace runs every cell in one "
        "model.sweep; plain hooks, below, one forward per cell.")
    sweep = patching_sweep(probe, clean, corrupt, clean_ans, corrupt_ans, length, progress)
    if hasattr(probe, "patched_all"):
        cells = n_layer * length
        loop = time_one_trace_per_cell(probe, clean, corrupt, length)
        say(f"{cells} cells: model.sweep took {sweep.seconds:.2f} s ({cells / sweep.seconds:.0f} "
            f"cells/s); one trace per cell takes {loop:.2f} s ({cells / loop:.0f} cells/s), "
            f"{loop / sweep.seconds:.1f}x longer.")
    rec = sweep.recovery
    rows = [[f"block {layer}"] + [f"{rec[layer, c].item():5.2f} {shade(rec[layer, c].item())}"
                                  for c in range(length)] for layer in range(n_layer)]
    say(format_table(["layer"] + labels, rows, align="l" + "r" * length))
    png = heatmap(rec.numpy(), [f"block {i}" for i in range(n_layer)], labels,
                  f"Where the capital is recalled: patching clean -> corrupted, {len(pairs)} "
                  f"pairs\n(subj1..subj{n_subj}: the country's tokens, e.g. {subj_example})",
                  args.cache_dir / "patching_heatmap.png")
    say(f"Heatmap written to {png.resolve()}")
    say(story(rec, labels, subject_start, n_subj))

    if reference is None:
        return True
    # cross-check --------------------------------------------------------------------------
    say("\n== 4. Cross-check: the same numbers with plain torch hooks ==")
    with torch.no_grad():
        ref_probs, _ = reference.lens(prompts)
    ref_sweep = patching_sweep(reference, clean, corrupt, clean_ans, corrupt_ans, length,
                               progress=False)
    d_lens = (ref_probs - probs).abs().max().item()
    d_patch = (ref_sweep.patched - sweep.patched).abs().max().item()
    agree = d_lens < 1e-4 and d_patch < 1e-3
    say(f"logit-lens probabilities: max |diff| = {d_lens:.1e}; patched logits: max |diff| = "
        f"{d_patch:.1e}")
    say("interlace and plain hooks agree." if agree else
        "interlace and plain hooks DISAGREE: the results above are suspect.")
    return agree


def story(rec, labels, subject_start, n_subj) -> str:
    """What the table says, in words, computed from the numbers (not written in advance)."""
    span = rec[:, subject_start:subject_start + n_subj]
    subj, best = span.max(-1).values, span.argmax(-1)
    last, end = rec[:, -1], repr(labels[-1])
    n_layer = rec.shape[0]
    lines = ["Reading the table:"]
    if subj[0] > last[0]:
        lines.append(f"- after block 0 the answer sits with the country: patching "
                     f"{labels[subject_start + int(best[0])]} restores {subj[0]:.2f}, patching "
                     f"{end} only {last[0]:.2f};")
    else:
        lines.append(f"- already after block 0, {end} holds more of the answer ({last[0]:.2f}) "
                     f"than the country's tokens ({subj[0]:.2f});")
    cross = next((layer for layer in range(1, n_layer) if last[layer] > subj[layer]), None)
    if subj[0] > last[0] and cross is not None:
        lines.append(f"- from block {cross} on, {end} holds more ({last[cross]:.2f} vs "
                     f"{subj[cross]:.2f}): the early blocks' attention moves the fact from the "
                     "country to the position that predicts the capital;")
    lines.append("- by block, the country's best cell fades (" +
                 ", ".join(f"{v:.2f}" for v in subj.tolist()) + f") while {end} grows (" +
                 ", ".join(f"{v:.2f}" for v in last.tolist()) + "); after the last block only "
                 f"{end} can matter, since no later block reads the other positions;")
    lines.append("- the tokens before the country are the same in both prompts, so patching "
                 f"them restores nothing ({rec[:, :subject_start].abs().max():.2f}): a sanity "
                 "check.")
    return "\n".join([lines[0]] + [
        textwrap.fill(line, WIDTH, initial_indent="  ", subsequent_indent="    ")
        for line in lines[1:]])


if __name__ == "__main__":
    sys.exit(main())
