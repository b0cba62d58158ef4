"""LanguageModel.generate: transformers generation with the body interleaved.

References: transformers' own `generate` on the same weights, with plain forward hooks doing
the same reads and edits at the same steps.
"""

import pytest
import torch

from conftest import StepHooks, encode, layers

import interlace
from interlace.models.language_model import UnknownKeywordError

PROMPT = "the capital of france is"
GREEDY = {"do_sample": False}


def hf_generate(hf_model, hf_tokenizer, text, n, **kwargs):
    ids = encode(hf_tokenizer, text)
    return hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, pad_token_id=hf_tokenizer.eos_token_id,
        **GREEDY, **kwargs,
    )


def test_result_is_the_generated_ids(lm, hf_model, hf_tokenizer):
    ref = hf_generate(hf_model, hf_tokenizer, PROMPT, 5)
    with lm.generate(PROMPT, max_new_tokens=5, **GREEDY) as tracer:
        ids = tracer.result.save()
    assert torch.equal(ids, ref)
    assert ids.shape[1] == encode(hf_tokenizer, PROMPT).shape[1] + 5


def test_reads_default_to_step_0(lm, hf_model, hf_tokenizer):
    with StepHooks(hf_model.lm_head) as ref:
        hf_generate(hf_model, hf_tokenizer, PROMPT, 3)
    with lm.generate(PROMPT, max_new_tokens=3, **GREEDY):
        logits = lm.lm_head.output.save()
    assert len(ref.outputs) == 3
    torch.testing.assert_close(logits, ref.outputs[0])  # step 0: the prompt pass
    assert not torch.allclose(logits, ref.outputs[1], atol=1e-3)


@pytest.mark.parametrize("step", [0, 2])
def test_edit_at_a_step_changes_later_tokens_like_plain_hooks(lm, hf_model, hf_tokenizer, arch, step):
    n = 6
    plain = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    edit = lambda s, out: out * 0 if s == step else None  # noqa: E731
    with StepHooks(layers(hf_model, arch)[0].mlp, edit):
        ref = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    with lm.generate(PROMPT, max_new_tokens=n, **GREEDY) as tracer:
        for _ in tracer.iter[step]:
            layers(lm, arch)[0].mlp.output[:] = 0
        ids = tracer.result.save()
    assert torch.equal(ids, ref)
    assert not torch.equal(ids, plain)
    start = encode(hf_tokenizer, PROMPT).shape[1]
    # Tokens before the edited step are untouched; the edit shows from that step on.
    assert torch.equal(ids[:, : start + step], plain[:, : start + step])


def test_assignment_edit_at_default_step(lm, hf_model, hf_tokenizer, arch):
    """`.output = value` with no loop applies to step 0 (the prompt pass) only."""
    n = 5
    plain = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    push = torch.linspace(-4.0, 4.0, 64)  # a direction (a constant would vanish in the norm)
    edit = lambda s, out: out + push if s == 0 else None  # noqa: E731
    with StepHooks(layers(hf_model, arch)[1], edit):
        ref = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    with lm.generate(PROMPT, max_new_tokens=n, **GREEDY) as tracer:
        layers(lm, arch)[1].output = layers(lm, arch)[1].output + push
        ids = tracer.result.save()
    assert torch.equal(ids, ref)
    assert not torch.equal(ids, plain)


def test_batched_generation_equals_each_prompt_alone(lm, hf_model, hf_tokenizer):
    prompts = ["hello", PROMPT, "a b c"]
    with lm.generate(prompts, max_new_tokens=4, **GREEDY) as tracer:
        ids = tracer.result.save()
    for i, text in enumerate(prompts):
        alone = hf_generate(hf_model, hf_tokenizer, text, 4)
        assert ids[i, -4:].tolist() == alone[0, -4:].tolist()


def test_invokes_generate_together_and_edit_their_own_rows(lm, hf_model, hf_tokenizer, arch):
    n = 5
    with lm.generate(max_new_tokens=n, **GREEDY) as tracer:
        with tracer.invoke("hello"):
            pass
        with tracer.invoke(PROMPT):
            for _ in tracer.iter[2]:
                layers(lm, arch)[0].mlp.output[:] = 0
    ids = tracer.result
    alone = hf_generate(hf_model, hf_tokenizer, "hello", n)
    assert ids[0, -n:].tolist() == alone[0, -n:].tolist()
    edit = lambda s, out: out * 0 if s == 2 else None  # noqa: E731
    with StepHooks(layers(hf_model, arch)[0].mlp, edit):
        ref = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    assert ids[1].tolist() == ref[0].tolist()
    assert ids[1].tolist() != hf_generate(hf_model, hf_tokenizer, PROMPT, n)[0].tolist()


def test_generate_kwargs_reach_transformers(lm, hf_model, hf_tokenizer):
    ref = hf_generate(hf_model, hf_tokenizer, PROMPT, 3, num_beams=2)
    with lm.generate(PROMPT, max_new_tokens=3, num_beams=2, **GREEDY) as tracer:
        ids = tracer.result.save()
    assert torch.equal(ids, ref)


def test_unknown_generate_kwarg_is_an_error(lm):
    with pytest.raises(UnknownKeywordError, match=r"neither generation nor the model take.*not_an_option") as info:
        with lm.generate(PROMPT, max_new_tokens=2, not_an_option=1) as tracer:
            tracer.result.save()
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    with lm.generate(PROMPT, max_new_tokens=1) as tracer:  # clean afterwards
        ids = tracer.result.save()
    assert ids.shape[1] == encode(lm.tokenizer, PROMPT).shape[1] + 1


def test_generate_needs_a_prompt(lm):
    with pytest.raises(interlace.InterlaceError, match=r"used outside an invoke"):
        with lm.generate(max_new_tokens=2):
            lm.lm_head.output.save()
    with pytest.raises(TypeError, match=r"no prompt was given"):
        with lm.generate(attention_mask=torch.ones(1, 2), max_new_tokens=2):
            lm.lm_head.output.save()


def test_no_grad_generation_keeps_interlace_usable(lm, hf_model, hf_tokenizer, arch):
    """A generation under torch.no_grad() leaves the model ready for the next trace, which
    runs with gradients again and reads what plain torch computes."""
    with torch.no_grad():
        with lm.generate(PROMPT, max_new_tokens=2, **GREEDY) as tracer:
            ids = tracer.result.save()
        assert not torch.is_grad_enabled()
    with torch.no_grad():
        assert torch.equal(ids, hf_generate(hf_model, hf_tokenizer, PROMPT, 2))
    assert torch.is_grad_enabled()
    with lm.trace(PROMPT):
        hidden = layers(lm, arch)[0].output[0].save()
        logits = lm.output.logits.save()
    captured = []
    handle = layers(hf_model, arch)[0].register_forward_hook(lambda m, i, o: captured.append(o[0]))
    try:
        ref = hf_model(encode(hf_tokenizer, PROMPT)).logits
    finally:
        handle.remove()
    assert hidden.requires_grad and logits.requires_grad  # the second trace ran with gradients
    torch.testing.assert_close(hidden, captured[0])
    torch.testing.assert_close(logits, ref)


def test_model_left_clean_after_generation_errors(lm, arch):
    def state():
        # (transformers keeps the output-capturing hooks it installs once a forward asked
        # for hidden states or attentions: what interlace set is what must be gone)
        return [(list(module._forward_hooks.values()), list(module._forward_pre_hooks.values()),
                 "forward" in module.__dict__) for module in lm._module.modules()]

    before = state()

    def clean():
        assert state() == before
        return True

    with pytest.raises(ZeroDivisionError):
        with lm.generate(PROMPT, max_new_tokens=3) as tracer:
            for step in tracer.iter[:3]:
                layers(lm, arch)[0].output.save()
                if step == 1:
                    1 / 0
    assert clean()
    with pytest.warns(interlace.IterationCutShortWarning):
        with lm.generate(PROMPT, max_new_tokens=2) as tracer:
            for step in tracer.all():
                layers(lm, arch)[1].skip(layers(lm, arch)[0].output)
    assert clean()
    with lm.generate(PROMPT, max_new_tokens=2) as tracer:
        ids = tracer.result.save()
    assert ids.shape[1] == encode(lm.tokenizer, PROMPT).shape[1] + 2


@pytest.mark.parametrize(
    "prompt, error, message",
    [
        ([], ValueError, r"the list of prompts is empty"),
        (42, TypeError, r"cannot use a value of type int as a prompt"),
        ([""], ValueError, r"prompt 0 is an empty string"),
    ],
)
def test_bad_prompts_to_generate(lm, prompt, error, message):
    with pytest.raises(error, match=message):
        with lm.generate(prompt, max_new_tokens=2) as tracer:
            tracer.result.save()
    with pytest.raises(error, match=message):
        with lm.generate(max_new_tokens=2) as tracer:
            with tracer.invoke(prompt):
                lm.lm_head.output.save()
