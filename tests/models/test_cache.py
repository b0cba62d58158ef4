"""`tracer.cache()` under generation and with padded prompts: against plain hooks.

Reference: transformers' own `generate` (and forward) on the same weights, with plain
forward hooks keeping each step's output; edits made by plain hooks at the same steps.
"""

import torch

from conftest import StepHooks, encode, layers

PROMPT = "the capital of france is"
GREEDY = {"do_sample": False}


def hf_generate(hf_model, hf_tokenizer, n):
    ids = encode(hf_tokenizer, PROMPT)
    return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             pad_token_id=hf_tokenizer.eos_token_id, **GREEDY)


def test_one_entry_per_step_equal_to_plain_hooks(lm, hf_model, hf_tokenizer, arch):
    layer = layers(lm, arch)[1]
    with lm.generate(PROMPT, max_new_tokens=4, **GREEDY) as tracer:
        cache = tracer.cache(modules=[layer, lm.lm_head])
    with StepHooks(layers(hf_model, arch)[1]) as block, StepHooks(hf_model.lm_head) as head:
        hf_generate(hf_model, hf_tokenizer, 4)
    for got, want in ((cache[layer._path], block.outputs), (cache.model.lm_head, head.outputs)):
        assert len(got) == len(want) == 4
        values = got.output
        assert isinstance(values, list) and len(values) == 4
        for a, b in zip(values, want):
            torch.testing.assert_close(a[0] if isinstance(a, tuple) else a, b)
    prompt = encode(hf_tokenizer, PROMPT).shape[1]
    block_out = [v[0] if isinstance(v, tuple) else v for v in cache[layer._path].output]
    assert [v.shape[1] for v in block_out] == [prompt, 1, 1, 1]  # the prompt pass, then a token each


def test_a_single_step_generation_still_gives_a_list(lm):
    """nnsight returns a bare value when the generation ran one step, a list otherwise; here
    a generation's values are always per-step lists."""
    with lm.generate(PROMPT, max_new_tokens=1, **GREEDY) as tracer:
        cache = tracer.cache(modules=[lm.lm_head])
    assert isinstance(cache.model.lm_head.output, list) and len(cache.model.lm_head.output) == 1
    with lm.trace(PROMPT) as tracer:
        single = tracer.cache(modules=[lm.lm_head])
    assert isinstance(single.model.lm_head.output, torch.Tensor)  # one forward: the value


def test_edits_at_a_step_show_in_that_steps_entry(lm, hf_model, hf_tokenizer, arch):
    step = 2
    with lm.generate(PROMPT, max_new_tokens=4, **GREEDY) as tracer:
        cache = tracer.cache(modules=[layers(lm, arch)[0].mlp, lm.lm_head])
        for _ in tracer.iter[step]:
            layers(lm, arch)[0].mlp.output[:] = 0
    edit = lambda s, out: out * 0 if s == step else None  # noqa: E731
    with StepHooks(layers(hf_model, arch)[0].mlp, edit) as mlp, StepHooks(hf_model.lm_head) as head:
        hf_generate(hf_model, hf_tokenizer, 4)
    mlps = cache[layers(lm, arch)[0].mlp._path].output
    assert [bool(m.abs().sum() == 0) for m in mlps] == [False, False, True, False]
    for a, b in zip(mlps, mlp.outputs):
        torch.testing.assert_close(a, b)
    for a, b in zip(cache.model.lm_head.output, head.outputs):
        torch.testing.assert_close(a, b)


def test_padded_invokes_cache_their_own_rows(lm, hf_model, hf_tokenizer, arch):
    short, long = "hello world", "the quick brown fox jumps over"
    with lm.trace() as tracer:
        with tracer.invoke(short):
            a = tracer.cache(modules=[lm.lm_head])
        with tracer.invoke(long):
            b = tracer.cache(modules=[lm.lm_head])
    for cache, text in ((a, short), (b, long)):
        ids = encode(hf_tokenizer, text)
        with torch.no_grad():
            want = hf_model(ids).logits
        got = cache.model.lm_head.output
        assert got.shape[0] == 1
        # left-padded: the prompt's own positions are its last ones
        torch.testing.assert_close(got[:, -ids.shape[1]:], want, rtol=1e-4, atol=1e-4)
