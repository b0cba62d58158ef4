"""`LanguageModel.edit()`: edits hold in generation (per step with `tracer.all()`), in batched
prompts of different lengths, and in generation sweeps.

Reference: transformers' own `generate`/forward on the same weights with plain forward hooks
doing the same edit at the same steps.
"""

import torch

from conftest import StepHooks, encode, layers

PROMPT = "the capital of france is"
GREEDY = {"do_sample": False}


def hf_generate(hf_model, hf_tokenizer, text, n):
    ids = encode(hf_tokenizer, text)
    return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             pad_token_id=hf_tokenizer.eos_token_id, **GREEDY)


def test_an_edit_over_tracer_all_holds_at_every_generation_step(lm, hf_model, hf_tokenizer, arch):
    n = 5
    plain = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    with StepHooks(hf_model.lm_head) as seen, \
            StepHooks(layers(hf_model, arch)[0].mlp, lambda step, out: out * 0):
        ref = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    with lm.edit() as (tracer, edited):
        for _ in tracer.all():  # ends quietly with each run: no IterationCutShortWarning
            layers(edited, arch)[0].mlp.output[:] = 0
    with torch.no_grad(), edited.generate(PROMPT, max_new_tokens=n, **GREEDY) as gen:
        logits = [].save()
        for _ in gen.iter[:n]:  # the trace's own loop sees the edited run
            logits.append(edited.lm_head.output)
        ids = gen.result.save()
    assert torch.equal(ids, ref)
    assert not torch.equal(ids, plain)
    assert len(logits) == len(seen.outputs) == n
    for mine, theirs in zip(logits, seen.outputs):
        torch.testing.assert_close(mine, theirs)
    with torch.no_grad(), lm.generate(PROMPT, max_new_tokens=n, **GREEDY) as gen:
        unedited = gen.result.save()
    assert torch.equal(unedited, plain)  # the original wrapper generates unedited


def test_an_edit_without_a_loop_applies_at_step_0_only(lm, hf_model, hf_tokenizer, arch):
    n = 5
    push = torch.linspace(-4.0, 4.0, 64)
    with StepHooks(layers(hf_model, arch)[1], lambda step, out: out + push if step == 0 else None):
        ref = hf_generate(hf_model, hf_tokenizer, PROMPT, n)
    with lm.edit() as edited:
        layers(edited, arch)[1].output = layers(edited, arch)[1].output + push
    with torch.no_grad(), edited.generate(PROMPT, max_new_tokens=n, **GREEDY) as gen:
        ids = gen.result.save()
    assert torch.equal(ids, ref)
    assert not torch.equal(ids, hf_generate(hf_model, hf_tokenizer, PROMPT, n))


def test_batched_prompts_of_different_lengths_each_equal_the_edited_prompt_alone(
        lm, hf_model, hf_tokenizer, arch):
    prompts = ["hello", PROMPT, "a b c d e f"]
    with lm.edit() as edited:
        layers(edited, arch)[0].mlp.output[:] = layers(edited, arch)[0].mlp.output * 2
    with torch.no_grad(), edited.trace() as tracer:
        outs = [].save()
        for prompt in prompts:
            with tracer.invoke(prompt):
                outs.append(edited.lm_head.output[:, -1].save())
    double = lambda step, out: out * 2  # noqa: E731
    for prompt, out in zip(prompts, outs):
        with torch.no_grad(), StepHooks(layers(hf_model, arch)[0].mlp, double):
            ref = hf_model(encode(hf_tokenizer, prompt)).logits[:, -1]
        with torch.no_grad():
            plain = hf_model(encode(hf_tokenizer, prompt)).logits[:, -1]
        torch.testing.assert_close(out, ref)
        assert not torch.allclose(out, plain, atol=1e-3)


def test_a_generation_sweep_applies_the_edit_to_every_item(lm, hf_model, hf_tokenizer, arch):
    prompts = ["hello world", PROMPT, "a b c"]
    with lm.edit() as (tracer, edited):
        for _ in tracer.all():
            layers(edited, arch)[0].mlp.output[:] = 0
    with torch.no_grad(), edited.sweep(prompts, generate=True, max_new_tokens=4, batch_size=2,
                                       progress=False, **GREEDY) as sweep:
        ids = sweep.output.save()
    zero = lambda step, out: out * 0  # noqa: E731
    changed = 0
    for prompt, value in zip(prompts, ids):
        with StepHooks(layers(hf_model, arch)[0].mlp, zero):
            ref = hf_generate(hf_model, hf_tokenizer, prompt, 4)
        assert torch.equal(value, ref)
        changed += not torch.equal(value, hf_generate(hf_model, hf_tokenizer, prompt, 4))
    assert changed
