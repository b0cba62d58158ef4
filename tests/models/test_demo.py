"""The demo's pieces (`python -m demo`), quick: corpus, tokenizer, tables, pairing, probes.

The minute of training is not run here; a few steps on a tiny world check the loop runs and
the cache round-trips. The full demo is `make demo`.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # demo/ is a top-level folder, not part of the package
    sys.path.insert(0, str(ROOT))

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from demo.analysis import HookProbe, InterlaceProbe, patching_pairs, patching_sweep  # noqa: E402
from demo.corpus import PROMPT, TEMPLATES, make_facts, sentences  # noqa: E402
from demo.report import format_table, heatmap, shade  # noqa: E402
from demo.train import (  # noqa: E402
    Settings,
    build_model,
    load_facts,
    load_or_train,
    recall,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def world():
    facts = make_facts(30, seed=0)
    tok = train_tokenizer(sentences(facts), vocab_size=350)
    return facts, tok


@pytest.fixture(scope="module")
def tiny(world):
    _, tok = world
    torch.manual_seed(0)
    model = build_model(tok, Settings(n_layer=2, n_embd=32, n_head=2)).eval()
    return model, tok


# -- corpus -----------------------------------------------------------------------------------

def test_facts_are_deterministic_and_all_names_distinct():
    a, b = make_facts(50, seed=3), make_facts(50, seed=3)
    assert a == b
    assert make_facts(50, seed=4) != a
    names = [n for f in a for n in (f.country, f.capital, f.currency)]
    assert len(names) == len(set(names)) == 150
    assert all(n[0].isupper() and n.isalpha() for n in names)


def test_every_template_is_filled_for_every_fact():
    facts = make_facts(5, seed=0)
    texts = sentences(facts)
    assert len(texts) == 5 * len(TEMPLATES)
    f = facts[0]
    assert f"{f.prompt} {f.capital} ." in texts
    assert f.prompt == PROMPT.format(country=f.country)
    assert not any("{" in t for t in texts)


# -- tokenizer --------------------------------------------------------------------------------

def test_tokenizer_round_trips_and_splits_names(world):
    facts, tok = world
    text = sentences(facts)[0]
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(tok) == 350
    # small vocabulary on purpose: most invented names take several tokens
    multi = sum(len(tok(" " + f.country)["input_ids"]) >= 2 for f in facts)
    assert multi >= len(facts) // 2
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"


def test_tokenizer_saves_and_loads_through_autotokenizer(world, tmp_path):
    from transformers import AutoTokenizer

    facts, tok = world
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(facts[1].prompt)["input_ids"] == tok(facts[1].prompt)["input_ids"]


# -- training and cache -----------------------------------------------------------------------

def test_settings_key_is_stable_and_tracks_every_setting():
    assert Settings().key() == Settings().key()
    assert Settings(steps=1).key() != Settings().key()
    assert Settings(seed=1).key() != Settings().key()


def test_a_few_steps_train_save_and_reuse(tmp_path):
    s = Settings(n_countries=4, vocab_size=300, n_layer=1, n_embd=16, n_head=2, steps=3,
                 batch_size=4, warmup=1)
    messages = []
    folder, info = load_or_train(tmp_path, s, log=messages.append, progress=False)
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    assert set(info) >= {"recall_accuracy", "train_seconds", "n_parameters", "settings"}
    assert [f.country for f in load_facts(folder)] == [f.country for f in make_facts(4, 0)]
    again, info2 = load_or_train(tmp_path, s, log=messages.append, progress=False)
    assert again == folder and info2 == info
    assert "Reusing" in messages[-1]


def test_recall_is_exact_greedy_match(tiny, world):
    model, tok = tiny
    facts, _ = world
    hits = recall(model, tok, facts[:4])
    assert len(hits) == 4 and all(isinstance(h, bool) for h in hits)
    # an untrained model does not know invented capitals
    assert sum(hits) == 0


# -- analysis ---------------------------------------------------------------------------------

def test_lens_of_the_last_block_is_the_model_output(tiny, world):
    model, tok = tiny
    probs, logits = HookProbe(model, tok).lens([f.prompt for f in world[0][:5]])
    assert probs.shape == (2, 5, len(tok))
    torch.testing.assert_close(probs[-1], logits.softmax(-1))
    assert not torch.allclose(probs[0], probs[-1])


def test_hook_patching_of_everything_at_the_end_gives_the_clean_logits(tiny, world):
    model, tok = tiny
    facts = world[0]
    length, pairs = patching_pairs([len(tok(f.prompt)["input_ids"]) for f in facts],
                                   [tok(" " + f.capital)["input_ids"][0] for f in facts], 3)
    clean = [facts[i].prompt for i, _ in pairs]
    corrupt = [facts[j].prompt for _, j in pairs]
    probe = HookProbe(model, tok)
    _, clean_logits = probe.lens(clean)
    _, corrupt_logits = probe.lens(corrupt)
    last = probe.patched_logits(clean, corrupt, probe.n_layer - 1, length - 1)
    torch.testing.assert_close(last, clean_logits)
    first = probe.patched_logits(clean, corrupt, 0, 0)  # "the": same token in both prompts
    torch.testing.assert_close(first, corrupt_logits)
    assert not torch.allclose(clean_logits, corrupt_logits)


def test_patching_pairs_use_one_length_and_different_answers():
    lengths = [6, 6, 7, 7, 7, 5, 5, 5, 5]
    first = [1, 2, 3, 3, 4, 5, 6, 7, 8]
    length, pairs = patching_pairs(lengths, first, subject_start=3)
    # length 5 has the biggest group but a one-token subject: not usable
    assert length == 7
    assert pairs == [(2, 4), (3, 4), (4, 2)]
    assert all(first[i] != first[j] and lengths[i] == lengths[j] == 7 for i, j in pairs)
    with pytest.raises(ValueError, match="multi-token subject"):
        patching_pairs([5, 5], [1, 2], subject_start=3)


def test_sweep_scores_zero_where_prompts_agree_and_one_at_the_end(tiny, world):
    model, tok = tiny
    facts = world[0]
    length, pairs = patching_pairs([len(tok(f.prompt)["input_ids"]) for f in facts],
                                   [tok(" " + f.capital)["input_ids"][0] for f in facts], 3)
    ans = [tok(" " + f.capital)["input_ids"][0] for f in facts]
    res = patching_sweep(HookProbe(model, tok), [facts[i].prompt for i, _ in pairs],
                         [facts[j].prompt for _, j in pairs], [ans[i] for i, _ in pairs],
                         [ans[j] for _, j in pairs], length, progress=False)
    assert res.recovery.shape == (2, length)
    torch.testing.assert_close(res.recovery[:, :3], torch.zeros(2, 3))
    torch.testing.assert_close(res.recovery[-1, -1], torch.tensor(1.0))


def test_interlace_probe_matches_plain_hooks(tiny, world):
    """The demo's cross-check in small: interlace reads and patches what hooks do."""
    import interlace

    model, tok = tiny
    facts = world[0]
    ilm = interlace.LanguageModel(model, tokenizer=tok)
    ours, ref = InterlaceProbe(ilm), HookProbe(model, tok)
    prompts = [f.prompt for f in facts[:6]]
    with torch.no_grad():
        got_probs, got_logits = ours.lens(prompts)
    ref_probs, ref_logits = ref.lens(prompts)
    torch.testing.assert_close(got_probs, ref_probs)
    torch.testing.assert_close(got_logits, ref_logits)
    length, pairs = patching_pairs([len(tok(f.prompt)["input_ids"]) for f in facts],
                                   [tok(" " + f.capital)["input_ids"][0] for f in facts], 3)
    clean = [facts[i].prompt for i, _ in pairs]
    corrupt = [facts[j].prompt for _, j in pairs]
    with torch.no_grad():
        got = ours.patched_logits(clean, corrupt, 0, length - 2)
    torch.testing.assert_close(got, ref.patched_logits(clean, corrupt, 0, length - 2))
    assert not torch.allclose(got, ref.lens(corrupt)[1])
    # the demo's patching section: every cell in one model.sweep, equal to hooks per cell
    cells = [(layer, pos) for layer in range(2) for pos in range(length)]
    with torch.no_grad():
        every = ours.patched_all(clean, corrupt, cells, progress=False)
    for (layer, pos), value in zip(cells, every):
        torch.testing.assert_close(value, ref.patched_logits(clean, corrupt, layer, pos))


# -- report -----------------------------------------------------------------------------------

def test_format_table_aligns_text_left_and_numbers_right():
    out = format_table(["name", "score"], [["a", 1.0], ["long name", 0.25]])
    assert out.splitlines() == [
        "name       score",
        "---------  -----",
        "a           1.00",
        "long name   0.25",
    ]
    with pytest.raises(ValueError, match="one cell per header"):
        format_table(["a", "b"], [[1]])


def test_shade_is_monotone_and_clamped():
    marks = [shade(x / 10) for x in range(11)]
    ramp = " .:-=+*#%@"
    assert [ramp.index(m) for m in marks] == sorted(ramp.index(m) for m in marks)
    assert shade(-1) == " " and shade(2) == "@"


def test_heatmap_writes_a_png(tmp_path):
    path = heatmap([[0.0, 0.5], [1.0, 0.2]], ["block 0", "block 1"], ["a", "b"], "t",
                   tmp_path / "sub" / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_story_is_read_off_the_numbers():
    from demo.__main__ import story

    rec = torch.tensor([[0.0, 0.6, 0.1, 0.1],
                        [0.0, 0.3, 0.0, 0.5],
                        [0.0, 0.0, 0.0, 1.0]])
    text = story(rec, ["of", "subj1", "subj2", "is"], subject_start=1, n_subj=2)
    assert all(len(line) <= 96 for line in text.splitlines())
    text = " ".join(text.split())  # unwrapped
    assert "patching subj1 restores 0.60, patching 'is' only 0.10" in text
    assert "from block 1 on, 'is' holds more (0.50 vs 0.30)" in text
    assert "(0.60, 0.30, 0.00)" in text and "(0.10, 0.50, 1.00)" in text
