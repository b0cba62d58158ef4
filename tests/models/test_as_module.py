"""`edited.as_module()`: a plain module of the original class whose every call runs the edits.

References: transformers' own forward/`generate` on the same weights with plain forward hooks
doing the same edit (`StepHooks`), and a trace of the same edits through `interlace.Model`
on the inputs as given.
"""

import copy
import weakref
import threading
import traceback

import pytest
import torch

import interlace
from conftest import StepHooks, layers
from interlace.errors import InterlaceError

GREEDY = {"do_sample": False}
PUSH = torch.linspace(-3.0, 3.0, 64)


def padded(tokenizer, side, n):
    """`n` prompts of different lengths, padded on `side` (batch of 1: no padding)."""
    texts = ["the capital of france is", "hello world", "a b c d e f g h"][:n]
    rows = [tokenizer(text)["input_ids"] for text in texts]
    width = max(map(len, rows))
    ids = torch.full((n, width), tokenizer.eos_token_id)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, where] = torch.tensor(row)
        mask[i, where] = 1
    return ids, mask


def hooked_logits(hf_model, arch, ids, mask):
    """The same two edits as `edit_of` makes, as plain forward hooks."""
    with torch.no_grad(), StepHooks(layers(hf_model, arch)[0].mlp, lambda s, out: out * 0), \
            StepHooks(layers(hf_model, arch)[1].mlp, lambda s, out: out + PUSH):
        return hf_model(input_ids=ids, attention_mask=mask).logits


def edit_of(wrapper, arch):
    with wrapper.edit() as edited:
        layers(edited, arch)[0].mlp.output[:] = 0
        layers(edited, arch)[1].mlp.output = layers(edited, arch)[1].mlp.output + PUSH
    return edited


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("n", [1, 3])
def test_forward_logits_equal_a_trace_with_the_same_edits(lm, hf_model, hf_tokenizer, arch,
                                                          side, n):
    ids, mask = padded(hf_tokenizer, side, n)
    module = edit_of(lm, arch).as_module()
    assert type(module).__name__ == type(hf_model).__name__
    assert isinstance(module, type(hf_model))
    with torch.no_grad():
        logits = module(input_ids=ids, attention_mask=mask).logits
        positional = module(ids, attention_mask=mask).logits
        plain = hf_model(input_ids=ids, attention_mask=mask).logits
    traced = edit_of(interlace.Model(hf_model), arch)
    with torch.no_grad(), traced.trace(input_ids=ids, attention_mask=mask):
        expected = traced.lm_head.output.save()
    assert torch.equal(logits, expected)
    assert torch.equal(positional, expected)
    assert torch.equal(logits, hooked_logits(hf_model, arch, ids, mask))
    assert not torch.allclose(logits, plain, atol=1e-3)
    with torch.no_grad():  # the module it shares weights with is never edited
        assert torch.equal(module_of_lm(lm)(input_ids=ids, attention_mask=mask).logits, plain)


def module_of_lm(lm):
    from interlace.intervention.access import module_of

    return module_of(lm)


def generate_kwargs(tokenizer, n):
    return dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=tokenizer.eos_token_id, **GREEDY)


def test_generate_equals_model_generate_with_a_per_step_edit(lm, hf_model, hf_tokenizer, arch):
    n = 5
    ids, mask = padded(hf_tokenizer, "left", 3)
    with lm.edit() as (tracer, edited):
        for _ in tracer.all():
            layers(edited, arch)[0].mlp.output[:] = 0
    module = edited.as_module()
    with torch.no_grad():
        tokens = module.generate(ids, attention_mask=mask, **generate_kwargs(hf_tokenizer, n))
    with torch.no_grad(), edited.generate(input_ids=ids, attention_mask=mask,
                                          **generate_kwargs(hf_tokenizer, n)) as gen:
        expected = gen.result.save()
    with torch.no_grad(), StepHooks(layers(hf_model, arch)[0].mlp, lambda s, out: out * 0):
        hooked = hf_model.generate(ids, attention_mask=mask, **generate_kwargs(hf_tokenizer, n))
    with torch.no_grad():
        plain = hf_model.generate(ids, attention_mask=mask, **generate_kwargs(hf_tokenizer, n))
    assert torch.equal(tokens, expected)
    assert torch.equal(tokens, hooked)
    assert not torch.equal(tokens, plain)


def test_an_edit_pinned_to_step_2_acts_at_that_step_of_generate_only(lm, hf_model, hf_tokenizer,
                                                                     arch):
    n = 5
    ids, mask = padded(hf_tokenizer, "left", 1)
    with lm.edit() as (tracer, edited):
        for _ in tracer.iter[2]:
            layers(edited, arch)[1].output = layers(edited, arch)[1].output + PUSH * 3
    module = edited.as_module()
    pushed = lambda step, out: out + PUSH * 3 if step == 2 else None  # noqa: E731
    with torch.no_grad(), StepHooks(layers(hf_model, arch)[1], pushed):
        hooked = hf_model.generate(ids, attention_mask=mask, **generate_kwargs(hf_tokenizer, n))
    with torch.no_grad():
        tokens = module.generate(ids, attention_mask=mask, **generate_kwargs(hf_tokenizer, n))
        plain = hf_model.generate(ids, attention_mask=mask, **generate_kwargs(hf_tokenizer, n))
        # a bare forward call is a run of one step: the edit of step 2 does nothing there
        assert torch.equal(module(ids, attention_mask=mask).logits,
                           hf_model(ids, attention_mask=mask).logits)
    assert torch.equal(tokens, hooked)
    assert not torch.equal(tokens, plain)


@pytest.fixture
def fresh(model_dir):
    """A LanguageModel of its own (the tests here move, edit in place or train it)."""
    return interlace.LanguageModel(model_dir)


def test_weights_are_shared_and_saved_without_edits(fresh, hf_model, hf_tokenizer, arch,
                                                     tmp_path):
    from transformers import AutoModelForCausalLM

    module = edit_of(fresh, arch).as_module()
    original = module_of_lm(fresh)
    mine, theirs = module.state_dict(), original.state_dict()
    assert list(mine) == list(theirs)
    assert all(mine[k].data_ptr() == theirs[k].data_ptr() for k in mine)  # no copy
    module.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(original)
    ids, mask = padded(hf_tokenizer, "left", 3)
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits,
                           hf_model(ids, attention_mask=mask).logits)
    # .to() moves the weights it shares; the edits still run after the move
    module.to(torch.float64)
    assert next(original.parameters()).dtype == torch.float64
    with torch.no_grad():
        assert module(ids, attention_mask=mask).logits.dtype == torch.float64
    module.to(torch.float32)
    with torch.no_grad():
        assert torch.equal(module(ids, attention_mask=mask).logits,
                           hooked_logits(hf_model, arch, ids, mask))


def test_deepcopy_copies_the_weights_and_keeps_the_edits(fresh, hf_model, hf_tokenizer, arch):
    module = edit_of(fresh, arch).as_module()
    twin = copy.deepcopy(module)
    assert type(twin) is type(module)
    first = next(iter(module.parameters()))
    assert next(iter(twin.parameters())).data_ptr() != first.data_ptr()
    ids, mask = padded(hf_tokenizer, "right", 3)
    expected = hooked_logits(hf_model, arch, ids, mask)
    with torch.no_grad():
        assert torch.equal(twin(ids, attention_mask=mask).logits, expected)
        for p in twin.parameters():
            p.zero_()  # the copy's weights are its own
        assert torch.equal(module(ids, attention_mask=mask).logits, expected)


def test_train_and_eval(fresh, arch):
    module = edit_of(fresh, arch).as_module()
    original = module_of_lm(fresh)
    original.eval()
    module.train()
    assert module.training and not original.training  # the flag of each root is its own
    assert layers(module, arch)[0].training  # the submodules are shared with the original
    module.eval()
    assert not module.training and not layers(original, arch)[0].training


def test_clear_edits_and_inplace_and_no_edits(fresh, hf_model, hf_tokenizer, arch):
    ids, mask = padded(hf_tokenizer, "left", 3)
    with torch.no_grad():
        plain = hf_model(ids, attention_mask=mask).logits
    clean = fresh.as_module()  # no edit: behaves as the original
    with torch.no_grad():
        assert torch.equal(clean(ids, attention_mask=mask).logits, plain)
    with fresh.edit(inplace=True):
        layers(fresh, arch)[0].mlp.output[:] = 0
        layers(fresh, arch)[1].mlp.output = layers(fresh, arch)[1].mlp.output + PUSH
    module = fresh.as_module()
    expected = hooked_logits(hf_model, arch, ids, mask)
    with torch.no_grad():
        assert torch.equal(module(ids, attention_mask=mask).logits, expected)
        assert torch.equal(clean(ids, attention_mask=mask).logits, expected)  # live: the wrapper's
        fresh.clear_edits()
        assert torch.equal(module(ids, attention_mask=mask).logits, plain)


def test_a_call_inside_a_trace_of_the_same_model_is_refused(fresh, hf_tokenizer, arch):
    ids, mask = padded(hf_tokenizer, "left", 1)
    edited = edit_of(fresh, arch)
    module = edited.as_module()
    with pytest.raises(InterlaceError, match="as_module.*while a trace of the same model"):
        with torch.no_grad(), edited.trace(ids):
            module(ids)
    with torch.no_grad():
        module(ids)  # still callable


def test_two_threads(fresh, hf_model, hf_tokenizer, arch):
    ids, mask = padded(hf_tokenizer, "left", 3)
    module = edit_of(fresh, arch).as_module()
    expected = hooked_logits(hf_model, arch, ids, mask)
    results, errors = [], []

    def work():
        try:
            with torch.no_grad():
                for _ in range(3):
                    results.append(module(ids, attention_mask=mask).logits)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 6
    assert all(torch.equal(r, expected) for r in results)


def test_an_error_in_an_edit_names_the_edit_line_and_the_module_stays_callable(
        fresh, hf_model, hf_tokenizer, arch):
    ids, mask = padded(hf_tokenizer, "left", 1)
    failing = [True]
    with fresh.edit() as edited:
        if failing[0]:
            raise ValueError("the edit failed")  # the line the traceback must show
        layers(edited, arch)[0].mlp.output[:] = 0
    with open(__file__) as source:
        line = 1 + next(i for i, text in enumerate(source) if "traceback must show" in text)
    module = edited.as_module()
    with pytest.raises(ValueError, match="the edit failed") as info:
        with torch.no_grad():
            module(ids, attention_mask=mask)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.filename == __file__ and f.lineno == line for f in frames), frames
    failing[0] = False
    with torch.no_grad(), StepHooks(layers(hf_model, arch)[0].mlp, lambda s, out: out * 0):
        expected = hf_model(ids, attention_mask=mask).logits
    with torch.no_grad():
        assert torch.equal(module(ids, attention_mask=mask).logits, expected)


def test_a_transformers_pipeline_over_the_exported_module(lm, hf_model, hf_tokenizer, arch):
    from transformers import pipeline

    with lm.edit() as (tracer, edited):
        for _ in tracer.all():
            layers(edited, arch)[0].mlp.output[:] = 0
    prompt = "the capital of france is"
    kwargs = generate_kwargs(hf_tokenizer, 4)
    steered = pipeline("text-generation", model=edited.as_module(), tokenizer=hf_tokenizer)
    text = steered(prompt, return_full_text=False, **kwargs)[0]["generated_text"]
    ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad(), StepHooks(layers(hf_model, arch)[0].mlp, lambda s, out: out * 0):
        hooked = hf_model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    with torch.no_grad():
        plain = hf_model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert text == hf_tokenizer.decode(hooked[0, ids.shape[1]:], skip_special_tokens=True)
    assert not torch.equal(hooked, plain)


def test_beam_search_and_pickling(fresh, hf_model, hf_tokenizer, arch, tmp_path):
    ids, mask = padded(hf_tokenizer, "left", 3)
    module = edit_of(fresh, arch).as_module()
    kwargs = dict(generate_kwargs(hf_tokenizer, 3), num_beams=2, num_return_sequences=2)
    first = lambda edit: lambda step, out: edit(out) if step == 0 else None  # noqa: E731
    with torch.no_grad(), StepHooks(layers(hf_model, arch)[0].mlp, first(lambda out: out * 0)), \
            StepHooks(layers(hf_model, arch)[1].mlp, first(lambda out: out + PUSH)):
        hooked = hf_model.generate(ids, attention_mask=mask, **kwargs)  # (no loop: step 0 only)
    with torch.no_grad():
        assert torch.equal(module.generate(ids, attention_mask=mask, **kwargs), hooked)
    torch.save(module, tmp_path / "module.pt")  # pickles as the original module, unedited
    loaded = torch.load(tmp_path / "module.pt", weights_only=False)
    assert type(loaded) is type(module_of_lm(fresh))
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits,
                           hf_model(ids, attention_mask=mask).logits)


def test_the_exported_module_and_its_wrapper_are_freed_by_refcounting(model_dirs, hf_tokenizer):
    """No reference cycle: the module holds its wrapper, the wrapper never holds the module."""
    from intervention.memcheck import assert_freed

    ids, mask = padded(hf_tokenizer, "left", 3)

    def run():
        lm = interlace.LanguageModel(model_dirs["gpt2"])
        with lm.edit() as (tracer, edited):
            for _ in tracer.all():
                layers(edited, "gpt2")[0].mlp.output[:] = 0
        module = edited.as_module()
        with torch.no_grad():
            module(ids, attention_mask=mask)
            module.generate(ids, attention_mask=mask, **generate_kwargs(hf_tokenizer, 2))
        return {"module": weakref.ref(module_of_lm(lm)),
                "wrapper": weakref.ref(edited),
                "exported": weakref.ref(module)}

    assert_freed(run)


@pytest.mark.parametrize("side", ["left", "right"])
def test_an_edit_written_for_one_prompt_applies_to_every_row(lm, hf_model, hf_tokenizer, arch,
                                                             side):
    """A row-indexed edit (`output[0]`, as written for one invoke) gets each row of the
    caller's batch: every row is replayed as its own invoke, as nnsight-style invokes are."""
    ids, mask = padded(hf_tokenizer, side, 3)
    with lm.edit() as edited:
        layers(edited, arch)[1].mlp.output[0, :, :8] = 0
    module = edited.as_module()

    def zero_every_row(step, out):
        out = out.clone()
        out[:, :, :8] = 0
        return out

    with torch.no_grad():
        logits = module(input_ids=ids, attention_mask=mask).logits
        with StepHooks(layers(hf_model, arch)[1].mlp, zero_every_row):
            expected = hf_model(input_ids=ids, attention_mask=mask).logits
        plain = hf_model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits, expected)
    assert not torch.allclose(logits[2], plain[2], atol=1e-4)  # not only row 0
