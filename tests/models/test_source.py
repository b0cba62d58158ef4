"""`.source` during generation: every step is one occurrence of each operation.

References: transformers' own `generate` on the same weights, with plain forward hooks on the
activation module that the MLP's activation operation calls.
"""

import torch

from conftest import StepHooks, encode, layers

PROMPT = "the capital of france is"
GREEDY = {"do_sample": False}
ACT = {"gpt2": ("act", "self_act_0"), "llama": ("act_fn", "self_act_fn_0")}


def hf_generate(hf_model, hf_tokenizer, n):
    ids = encode(hf_tokenizer, PROMPT)
    return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             pad_token_id=hf_tokenizer.eos_token_id, **GREEDY)


def test_each_step_reads_its_own_occurrence(lm, hf_model, hf_tokenizer, arch):
    module, op = ACT[arch]
    with StepHooks(getattr(layers(hf_model, arch)[0].mlp, module)) as ref:
        hf_generate(hf_model, hf_tokenizer, 4)
    with lm.generate(PROMPT, max_new_tokens=4, min_new_tokens=4, **GREEDY) as tracer:
        outs = [].save()
        for step in tracer.iter[:4]:
            outs.append(getattr(layers(lm, arch)[0].mlp.source, op).output.clone())
    assert len(outs) == len(ref.outputs) == 4
    for got, want in zip(outs, ref.outputs):
        torch.testing.assert_close(got, want)
    assert outs[0].shape[1] > 1 and outs[1].shape[1] == 1  # the prompt pass, then one token


def test_edit_at_a_later_step_first_used_there(lm, hf_model, hf_tokenizer, arch):
    """`.source` first used at step 2, after the model ran steps 0 and 1: still step 2."""
    module, op = ACT[arch]
    n = 5
    plain = hf_generate(hf_model, hf_tokenizer, n)
    edit = lambda s, out: out * 0 if s == 2 else None  # noqa: E731
    with StepHooks(getattr(layers(hf_model, arch)[0].mlp, module), edit):
        ref = hf_generate(hf_model, hf_tokenizer, n)
    with lm.generate(PROMPT, max_new_tokens=n, min_new_tokens=n, **GREEDY) as tracer:
        for step in tracer.iter[:n]:
            if step == 2:
                getattr(layers(lm, arch)[0].mlp.source, op).output[:] = 0
            lm.lm_head.output.save()
        ids = tracer.result.save()
    assert torch.equal(ids, ref)
    assert not torch.equal(ids, plain)
    start = encode(hf_tokenizer, PROMPT).shape[1]
    assert torch.equal(ids[:, : start + 2], plain[:, : start + 2])
