"""Attachments in edits: a module added to the model inside `model.edit()`'s reach (an
adapter) and applied by the edit as `envoy(x, hook=True)` replaces the activation it is
applied to, per invoke, once without `iter` and at every step with it, in traces, sweeps and
generation; its internals (`adapter.down.output`) are readable and equal a direct call of
the module on the same input (nnsight 0.8.1's documented form, `Envoy.__call__`).

Reference: transformers' own forward/`generate` on the same weights, with a plain forward
hook on the MLP that applies the same adapter (called directly) at the same steps.
"""

import pytest
import torch

import interlace
from conftest import StepHooks, encode

PROMPTS = ["the capital of france is", "hello", "a b c d e"]
GREEDY = {"do_sample": False}


class Adapter(torch.nn.Module):
    """A bottleneck adapter, as a user writes one: residual down/up projection."""

    def __init__(self, hidden=64, rank=8):
        super().__init__()
        torch.manual_seed(7)
        self.down = torch.nn.Linear(hidden, rank)
        self.up = torch.nn.Linear(rank, hidden)

    def forward(self, h):
        return h + 3 * self.up(torch.relu(self.down(h)))


@pytest.fixture
def attached(model_dirs):
    """A fresh GPT-2 LanguageModel with an adapter attached to block 0's MLP after wrapping
    (fresh: attaching changes the module tree)."""
    lm = interlace.LanguageModel(model_dirs["gpt2"])
    lm.transformer.h[0].mlp.adapter = Adapter()
    return lm


@pytest.fixture
def hf_gpt2(model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dirs["gpt2"]
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _adapting(adapter, downs, steps=None, inputs=None):
    """The reference edit for StepHooks: apply `adapter` (at `steps`, or every step) and
    record what its `down` projection gives on that input (and the input)."""

    def edit(step, out):
        if steps is not None and step not in steps:
            return None
        if inputs is not None:
            inputs.append(out.clone())
        downs.append(adapter.down(out))
        return adapter(out)

    return edit


def _generate(hf, tok, prompt, n):
    ids = encode(tok, prompt)
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       pad_token_id=tok.eos_token_id, **GREEDY)


def test_an_attachment_replaces_the_activation_and_its_internals_equal_a_direct_call(
        attached, hf_gpt2):
    hf, tok = hf_gpt2
    adapter = attached.transformer.h[0].mlp.adapter._module
    with attached.edit() as edited:
        mlp = edited.transformer.h[0].mlp
        mlp.output = mlp.adapter(mlp.output, hook=True)
    with torch.no_grad(), edited.trace(PROMPTS[0]):
        adapter_in = edited.transformer.h[0].mlp.adapter.input.save()
        down = edited.transformer.h[0].mlp.adapter.down.output.save()
        logits = edited.lm_head.output.save()
    downs, inputs = [], []
    with torch.no_grad(), StepHooks(hf.transformer.h[0].mlp, _adapting(adapter, downs, None, inputs)):
        ref = hf(encode(tok, PROMPTS[0])).logits
    torch.testing.assert_close(adapter_in, inputs[0])
    torch.testing.assert_close(down, downs[0])
    torch.testing.assert_close(logits, ref)
    with torch.no_grad():
        assert not torch.allclose(logits, hf(encode(tok, PROMPTS[0])).logits, atol=1e-3)
        unedited = attached.trace(PROMPTS[0], trace=False).logits  # the wrapper stays clean
        torch.testing.assert_close(unedited, hf(encode(tok, PROMPTS[0])).logits)


def test_each_invoke_applies_the_attachment_to_its_own_rows(attached, hf_gpt2):
    hf, tok = hf_gpt2
    adapter = attached.transformer.h[0].mlp.adapter._module
    with attached.edit() as edited:
        mlp = edited.transformer.h[0].mlp
        mlp.output = mlp.adapter(mlp.output, hook=True)
    with torch.no_grad(), edited.trace() as tracer:
        downs, lasts = [].save(), [].save()
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                downs.append(edited.transformer.h[0].mlp.adapter.down.output[:, -1])
                lasts.append(edited.lm_head.output[:, -1])
    for prompt, down, last in zip(PROMPTS, downs, lasts):  # each prompt alone, plain torch
        seen = []
        with torch.no_grad(), StepHooks(hf.transformer.h[0].mlp, _adapting(adapter, seen)):
            ref = hf(encode(tok, prompt)).logits[:, -1]
        torch.testing.assert_close(down, seen[0][:, -1])
        torch.testing.assert_close(last, ref)


def test_without_iter_the_attachment_applies_at_step_0_only(attached, hf_gpt2):
    hf, tok = hf_gpt2
    adapter = attached.transformer.h[0].mlp.adapter._module
    n = 4
    with attached.edit() as edited:
        mlp = edited.transformer.h[0].mlp
        mlp.output = mlp.adapter(mlp.output, hook=True)
    with torch.no_grad(), edited.generate(PROMPTS[0], max_new_tokens=n, **GREEDY) as gen:
        down = edited.transformer.h[0].mlp.adapter.down.output.save()
        ids = gen.result.save()
    downs = []
    with torch.no_grad(), StepHooks(hf.transformer.h[0].mlp, _adapting(adapter, downs, {0})):
        ref = _generate(hf, tok, PROMPTS[0], n)
    assert torch.equal(ids, ref) and len(downs) == 1
    torch.testing.assert_close(down, downs[0])
    assert not torch.equal(ids, _generate(hf, tok, PROMPTS[0], n))


def test_with_iter_the_attachment_applies_at_every_generation_step(attached, hf_gpt2):
    hf, tok = hf_gpt2
    adapter = attached.transformer.h[0].mlp.adapter._module
    n = 4
    with attached.edit() as (tracer, edited):
        for _ in tracer.iter[:]:
            mlp = edited.transformer.h[0].mlp
            mlp.output = mlp.adapter(mlp.output, hook=True)
    with torch.no_grad(), edited.generate(PROMPTS[0], max_new_tokens=n, **GREEDY) as gen:
        downs = [].save()
        for _ in gen.iter[:n]:
            downs.append(edited.transformer.h[0].mlp.adapter.down.output)
        ids = gen.result.save()
    seen = []
    with torch.no_grad(), StepHooks(hf.transformer.h[0].mlp, _adapting(adapter, seen)):
        ref = _generate(hf, tok, PROMPTS[0], n)
    assert torch.equal(ids, ref)
    assert len(downs) == len(seen) == n
    for mine, theirs in zip(downs, seen):
        torch.testing.assert_close(mine, theirs)


def test_a_sweep_applies_the_attachment_per_item(attached, hf_gpt2):
    hf, tok = hf_gpt2
    adapter = attached.transformer.h[0].mlp.adapter._module
    with attached.edit() as edited:
        mlp = edited.transformer.h[0].mlp
        mlp.output = mlp.adapter(mlp.output, hook=True)
    prompts = PROMPTS + ["paris is the capital of"]
    with torch.no_grad(), edited.sweep(prompts, batch_size=2, progress=False) as sweep:
        down = edited.transformer.h[0].mlp.adapter.down.output[:, -1].save()
        last = sweep.output.logits[:, -1].save()
    for prompt, mine, logits in zip(prompts, down, last):
        seen = []
        with torch.no_grad(), StepHooks(hf.transformer.h[0].mlp, _adapting(adapter, seen)):
            ref = hf(encode(tok, prompt)).logits[:, -1]
        torch.testing.assert_close(mine, seen[0][:, -1])
        torch.testing.assert_close(logits, ref)


def test_a_trace_body_can_edit_the_attachments_internals(attached, hf_gpt2):
    """An edit of `adapter.down.output` reaches the adapter's output, as a hook inside it would."""
    hf, tok = hf_gpt2
    adapter = attached.transformer.h[0].mlp.adapter._module
    with attached.edit() as edited:
        mlp = edited.transformer.h[0].mlp
        mlp.output = mlp.adapter(mlp.output, hook=True)
    with torch.no_grad(), edited.trace(PROMPTS[1]):
        edited.transformer.h[0].mlp.adapter.down.output[:] = 0
        logits = edited.lm_head.output.save()
    handle = adapter.down.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    try:
        with torch.no_grad(), StepHooks(hf.transformer.h[0].mlp, _adapting(adapter, [])):
            ref = hf(encode(tok, PROMPTS[1])).logits
    finally:
        handle.remove()
    torch.testing.assert_close(logits, ref)
