"""Prompt preparation: every accepted form, left padding, masks, positions, clear errors.

The reference is the plain transformers model run on each prompt alone, unpadded.
"""

import types

import pytest
import torch

from interlace import save
from interlace.models import inputs

PROMPTS = ["hello", "the capital of france is paris and", "a b c"]


def alone_logits(hf_model, hf_tokenizer, text):
    ids = torch.tensor([hf_tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return hf_model(ids).logits[0]


def run(hf_model, batch):
    pos = inputs.position_ids(batch["attention_mask"])
    with torch.no_grad():
        return hf_model(**batch, position_ids=pos).logits


def test_each_prompt_in_a_batch_equals_it_alone(hf_model, hf_tokenizer):
    batch = inputs.prepare(PROMPTS, hf_tokenizer)
    lengths = [len(hf_tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert len(set(lengths)) == 3  # really different lengths
    width = max(lengths)
    assert batch["input_ids"].shape == (3, width)
    # Left padding: real tokens end in the last column; the mask marks them.
    for i, n in enumerate(lengths):
        assert batch["attention_mask"][i].tolist() == [0] * (width - n) + [1] * n
        assert batch["input_ids"][i, width - n:].tolist() == hf_tokenizer(PROMPTS[i])["input_ids"]
        assert (batch["input_ids"][i, : width - n] == hf_tokenizer.eos_token_id).all()
    logits = run(hf_model, batch)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(logits[i, width - n:], alone_logits(hf_model, hf_tokenizer, PROMPTS[i]))


def test_without_position_ids_gpt2_would_differ(gpt2_lm):
    """Why position_ids matter: GPT-2 counts positions from column 0 unless told."""
    module, tokenizer = gpt2_lm._module, gpt2_lm.tokenizer
    batch = inputs.prepare(PROMPTS, tokenizer)
    with torch.no_grad():
        wrong = module(**batch).logits[0, -1]
        right = run(module, batch)[0, -1]
    alone = alone_logits(module, tokenizer, PROMPTS[0])[-1]
    torch.testing.assert_close(right, alone)
    assert not torch.allclose(wrong, alone, atol=1e-3)


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 1]])
    assert inputs.position_ids(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 1]]


def test_every_form_gives_the_same_batch(hf_tokenizer):
    ids = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    ref = inputs.prepare(PROMPTS, hf_tokenizer)
    encoded_right = hf_tokenizer(PROMPTS, padding=True, return_tensors="pt") if hf_tokenizer.pad_token else None
    forms = {
        "list of id lists": ids,
        "tensors in a list": [torch.tensor(x) for x in ids],
        "dict": {"input_ids": ref["input_ids"], "attention_mask": ref["attention_mask"]},
    }
    for name, form in forms.items():
        got = inputs.prepare(form, hf_tokenizer)
        assert got.keys() == ref.keys(), name
        for k in ref:
            assert torch.equal(got[k], ref[k]), name
    assert encoded_right is None  # the folder's tokenizer has no pad token (GPT-2 style)


def test_right_padded_tokenizer_output_is_kept_as_given_or_repadded_left_to_generate(lm):
    """One invoke's encoding reaches the model as the user tokenized it (right padding kept);
    a generation's prompts (strip=True), and invokes of different widths, are left-padded."""
    tok = lm.tokenizer
    tok.padding_side = "right"
    try:
        encoded = tok(PROMPTS, padding=True, return_tensors="pt")
    finally:
        tok.padding_side = "left"
    assert encoded["attention_mask"][0, -1] == 0  # right padded
    got = inputs.prepare(encoded, tok)
    for k in ("input_ids", "attention_mask"):
        assert torch.equal(got[k], encoded[k])
    ref = inputs.prepare(PROMPTS, tok)
    stripped = inputs.prepare(encoded, tok, strip=True)
    for k in ref:
        assert torch.equal(stripped[k], ref[k])
    wider = inputs.prepare(PROMPTS + ["a much longer prompt than the others are"], tok)
    combined, _ = inputs.combine([got, wider], tok, [inputs.trim(got), inputs.trim(wider)])
    n = len(PROMPTS)
    assert torch.equal(combined["attention_mask"][:n, -ref["input_ids"].shape[1]:], ref["attention_mask"])
    assert torch.equal(combined["input_ids"][:n, -ref["input_ids"].shape[1]:], ref["input_ids"])


def test_single_forms(hf_tokenizer):
    ids = hf_tokenizer(PROMPTS[1])["input_ids"]
    ref = inputs.prepare(PROMPTS[1], hf_tokenizer)
    assert ref["input_ids"].tolist() == [ids] and ref["attention_mask"].tolist() == [[1] * len(ids)]
    for form in (ids, torch.tensor(ids), torch.tensor([ids])):
        got = inputs.prepare(form, hf_tokenizer)
        assert torch.equal(got["input_ids"], ref["input_ids"])
        assert torch.equal(got["attention_mask"], ref["attention_mask"])


def test_tensor_with_mask_keyword(hf_tokenizer):
    batch = inputs.prepare(PROMPTS, hf_tokenizer)
    got = inputs.prepare(batch["input_ids"], hf_tokenizer, attention_mask=batch["attention_mask"])
    assert torch.equal(got["input_ids"], batch["input_ids"])
    assert torch.equal(got["attention_mask"], batch["attention_mask"])


def test_token_ids_need_no_tokenizer():
    got = inputs.prepare([[5, 6, 7], [8]], None)
    assert got["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert got["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_combine_invokes_left_pads_across_them(hf_tokenizer):
    a = inputs.prepare(PROMPTS[0], hf_tokenizer)
    b = inputs.prepare(PROMPTS[1:], hf_tokenizer)
    both, slices = inputs.combine([a, b], hf_tokenizer)
    ref = inputs.prepare(PROMPTS, hf_tokenizer)
    assert slices == [slice(0, 1), slice(1, 3)]
    for k in ref:
        assert torch.equal(both[k], ref[k])


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ([], ValueError, r"the list of prompts is empty: pass at least one prompt"),
        ("", ValueError, r"prompt 0 is an empty string"),
        (["ok", ""], ValueError, r"prompt 1 is an empty string"),
        (3, TypeError, r"cannot use a value of type int as a prompt; accepted inputs are a string, a list of strings"),
        (None, TypeError, r"cannot use a value of type NoneType as a prompt"),
        (["a", 1], TypeError, r"cannot use a list of int, str values as prompts"),
        (torch.tensor([[0.5, 1.0]]), TypeError, r"integer token ids, got a tensor of dtype torch.float32"),
        (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"must be 1-D .* or 2-D .*got shape \(1, 2, 3\)"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, r"input_ids is empty"),
        ({"attention_mask": [[1]]}, TypeError, r"an input dict must contain 'input_ids'"),
        ({"input_ids": [[1]], "pixel_values": [[1]]}, TypeError, r"cannot batch the input dict's fields \['pixel_values'\]"),
        ({"input_ids": [[1, 2]], "attention_mask": [[0, 0]]}, ValueError, r"attention_mask is all zeros"),
    ],
)
def test_bad_inputs(hf_tokenizer, bad, error, message):
    with pytest.raises(error, match=message):
        inputs.prepare(bad, hf_tokenizer)


def test_text_without_tokenizer():
    with pytest.raises(TypeError, match=r"string prompts need a tokenizer.*pass tokenizer=\.\.\."):
        inputs.prepare("hello", None)


def test_mask_shape_mismatch(hf_tokenizer):
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 2\) but input_ids has shape \(1, 3\)"):
        inputs.prepare(torch.tensor([[1, 2, 3]]), hf_tokenizer, attention_mask=torch.tensor([[1, 1]]))


@pytest.mark.parametrize("form", ["2-D long", "1-D long", "int32", "a non-contiguous view"])
def test_a_tensor_of_ids_gives_the_batch_its_rows_give_and_a_copy_of_them(form):
    rows = [[5, 6, 7, 8], [9, 10, 11, 12]]
    if form == "2-D long":
        ids = torch.tensor(rows)
    elif form == "1-D long":
        ids, rows = torch.tensor(rows[0]), rows[:1]
    elif form == "int32":
        ids = torch.tensor(rows, dtype=torch.int32)
    else:
        ids = torch.tensor(rows).t().contiguous().t()
        assert not ids.is_contiguous()
    before = ids.clone()
    got = inputs.prepare(ids)
    ref = inputs.prepare(rows)  # the same ids as lists: row by row, then stacked
    assert got.keys() == ref.keys()
    for key in ref:
        assert torch.equal(got[key], ref[key]) and got[key].dtype == torch.long, key
    assert inputs.trim(got) is None and inputs.trim(ref) is None
    got["input_ids"].zero_()  # the model's input edited in place never reaches the user's
    assert torch.equal(ids, before)


def test_invokes_of_one_width_are_stacked_as_given_with_their_rows(hf_tokenizer):
    """Batches of one width combine into what the same prompts prepared together give,
    right padding and all (nothing of a batch's own padding is stripped)."""
    right = {"input_ids": torch.tensor([[5, 6, 0], [7, 8, 9]]), "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    ids = torch.tensor([[1, 2, 3]])
    batches = [inputs.prepare(ids), inputs.prepare(right), inputs.prepare([4, 5, 6])]
    combined, slices = inputs.combine(batches, hf_tokenizer, [inputs.trim(b) for b in batches])
    assert slices == [slice(0, 1), slice(1, 3), slice(3, 4)]
    assert combined["input_ids"].tolist() == [[1, 2, 3], [5, 6, 0], [7, 8, 9], [4, 5, 6]]
    assert combined["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]]


def test_a_traced_edit_of_the_input_ids_leaves_the_users_tensor_alone(gpt2_lm):
    lm = gpt2_lm
    ids = torch.tensor([[5, 6, 7, 8]])
    before = ids.clone()
    with torch.no_grad(), lm.trace(ids):
        seen = lm.transformer.wte.input.clone().save()
        lm.transformer.wte.input[:] = 0
    assert torch.equal(seen, before) and torch.equal(ids, before)


class _OnDevice(torch.nn.Module):
    """An input embedding that says it lives on `device` (no such device is needed here)."""

    def __init__(self, device):
        super().__init__()
        self.weight = types.SimpleNamespace(device=torch.device(device))


def test_the_input_device_follows_the_models_input_embeddings_as_they_are_replaced():
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)
    module = GPT2LMHeadModel(config)
    batcher = inputs.PromptBatcher(module, None)

    def reference():  # what transformers says, asked now
        return module.get_input_embeddings().weight.device

    assert batcher.input_device == reference() == torch.device("cpu")
    module.set_input_embeddings(_OnDevice("cuda:3"))
    assert batcher.input_device == reference() == torch.device("cuda:3")
    module.set_input_embeddings(_OnDevice("cuda:5"))
    assert batcher.input_device == reference() == torch.device("cuda:5")
    module.transformer = GPT2Model(config)  # a replaced submodule holding the embedding
    module.transformer.wte = _OnDevice("cuda:7")
    assert batcher.input_device == reference() == torch.device("cuda:7")
    del module.transformer.wte  # the path is gone: asked again (no embedding: the parameters')
    assert batcher.input_device == torch.device("cpu")
    module.transformer.wte = _OnDevice("cuda:2")
    assert batcher.input_device == reference() == torch.device("cuda:2")


def test_an_input_embedding_outside_the_module_tree_is_asked_for_every_time():
    from transformers import GPT2Config, GPT2LMHeadModel

    class Outside(GPT2LMHeadModel):
        def get_input_embeddings(self):
            return self.__dict__["outside"]

    module = Outside(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    module.__dict__["outside"] = _OnDevice("cuda:1")
    batcher = inputs.PromptBatcher(module, None)
    assert batcher.input_device == torch.device("cuda:1")
    module.__dict__["outside"] = _OnDevice("cuda:4")
    assert batcher.input_device == torch.device("cuda:4")


def test_stacked_id_tensors_get_the_inputs_the_same_prompts_as_lists_get(hf_tokenizer):
    """Invokes of id tensors of one width take the stacking shortcut (a mask of ones, its
    positions counted in two ops); the same prompts as lists take the general padding path.
    Both must hand the model the same keywords, positions included."""
    from transformers import GPT2Config, GPT2LMHeadModel

    module = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    batcher = inputs.PromptBatcher(module, hf_tokenizer)
    rows = [[5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]]
    _, stacked = batcher.batch([batcher.prepare((torch.tensor([row]),), {}) for row in rows])
    _, listed = batcher.batch([batcher.prepare((row,), {}) for row in rows])
    assert stacked.keys() == listed.keys() == {"input_ids", "attention_mask", "position_ids"}
    for key in listed:
        assert torch.equal(stacked[key], listed[key]) and stacked[key].dtype == listed[key].dtype, key
    assert stacked["position_ids"].tolist() == [[0, 1, 2, 3]] * 3


_UNPADDED = {"attention_mask": lambda n: [[1] * n], "position_ids": lambda n: [list(range(n))]}


def _ones_and_counts(kwargs, n):
    """Do the model's keywords carry a mask of ones and positions 0..n-1 for one row of n?"""
    return all(kwargs[name].tolist() == row(n) for name, row in _UNPADDED.items())


def test_each_trace_gets_a_mask_of_ones_and_positions_whatever_earlier_traces_did(gpt2_lm, model_dirs):
    """The mask and positions a trace of token ids gets are ones and 0..n-1, whatever an
    earlier trace did with its own: kept them (saved `model.inputs`), edited them in place,
    ran on a scan's fake tensors, or ran under inference mode. A pair a user kept is never the one a later trace gets,
    and the later trace's edit never reaches it. The reference for the logits is the plain
    model run on the ids."""
    from transformers import AutoModelForCausalLM

    lm, ids = gpt2_lm, torch.tensor([[5, 6, 7, 8, 9]])
    plain = AutoModelForCausalLM.from_pretrained(model_dirs["gpt2"]).eval()
    with torch.no_grad():
        expected = plain(ids).logits
    for _ in range(3):  # (warm: the same shape again)
        with torch.no_grad(), lm.trace(ids):
            pass
    kept = {}
    for name in _UNPADDED:  # a user keeps one of the pair; the next trace edits its own
        with torch.no_grad(), lm.trace(ids):
            kept[name] = lm.inputs[1][name].save()
        with torch.no_grad(), lm.trace(ids):
            given = lm.inputs[1]
            given["attention_mask"][:, :2] = 0  # in place: this trace's own pair, and only its
            given["position_ids"][:, :2] = 7
            shared = save([given[name] is kept[name]])
        assert shared == [False] and kept[name].tolist() == _UNPADDED[name](5)
    for name, value in (("attention_mask", 0), ("position_ids", 7)):  # one edited in place
        with torch.no_grad(), lm.trace(ids):
            lm.inputs[1][name][:, :2] = value
            edited = lm.output.logits.save()
        assert not torch.allclose(edited, expected, atol=1e-4)  # the edit reached the model
        with torch.no_grad(), lm.trace(ids):
            got = lm.inputs.save()
            logits = lm.output.logits.save()
        assert _ones_and_counts(got[1], 5)
        torch.testing.assert_close(logits, expected)
    longer = torch.tensor([[5, 6, 7, 8, 9, 10]])  # a shape no trace gave a pair for yet
    with lm.scan(longer):  # fake tensors: its mask must not reach a real trace
        pass
    with torch.no_grad(), lm.trace(longer):
        got = lm.inputs.save()
        logits = lm.output.logits.save()
    assert type(logits) is torch.Tensor and _ones_and_counts(got[1], 6)
    with torch.no_grad():
        torch.testing.assert_close(logits, plain(longer).logits)
    for mode in (torch.inference_mode, torch.inference_mode, torch.no_grad):
        with mode(), lm.trace(ids):
            got = lm.inputs.save()
            logits = lm.output.logits.save()
        assert _ones_and_counts(got[1], 5)
        torch.testing.assert_close(logits, expected)
    assert _ones_and_counts(kept, 5)
