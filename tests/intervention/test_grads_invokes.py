"""Gradients through batched invokes: each invoke's `.grad` equals that item run alone.

Each invoke's `h` is one invoke's rows of the batch's tensor; the backward pass reaches the
batch tensor, so the gradient handed over is its rows. The reference is plain
`torch.autograd.grad` on the model run on each item alone, with forward hooks keeping `h`.
"""

import pytest
import torch

from interlace.intervention import grads

from .helpers import assert_clean


def _prompts():
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 1000, (1, 10), generator=g), torch.randint(0, 1000, (1, 10), generator=g)


def _alone(gpt2, ids, layers=(1, 0), edit_grad=None):
    """Gradients of `logits[:, -1].logsumexp` w.r.t. the given blocks' outputs, ids alone.

    `edit_grad(layer, grad)` may replace the gradient flowing back through a block (a tensor
    hook, torch's own way), to compare with an edit of `.grad` inside a trace.
    """
    kept = {}
    handles = [
        gpt2.transformer.h[i].register_forward_hook(lambda m, a, out, i=i: kept.__setitem__(i, out))
        for i in layers
    ]
    try:
        logits = gpt2(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    if edit_grad is not None:
        for i in layers:
            kept[i].register_hook(lambda g, i=i: edit_grad(i, g))
    loss = logits[:, -1].logsumexp(-1).sum()
    return dict(zip(layers, torch.autograd.grad(loss, [kept[i] for i in layers])))


def test_backward_in_one_invoke_of_two(gpt2, gpt2_model):
    a, b = _prompts()
    with gpt2_model.trace() as tracer:
        with tracer.invoke(a):
            pass_through = gpt2_model.lm_head.output[:, -1].sum().save()
        with tracer.invoke(b):
            h0 = gpt2_model.transformer.h[0].output
            h1 = gpt2_model.transformer.h[1].output
            loss = gpt2_model.lm_head.output[:, -1].logsumexp(-1).sum()
            with loss.backward():
                g1 = h1.grad.save()
                g0 = h0.grad.save()
    want = _alone(gpt2, b)
    assert g1.shape == want[1].shape and g0.shape == want[0].shape
    assert torch.allclose(g1, want[1], atol=1e-6)
    assert torch.allclose(g0, want[0], atol=1e-6)
    assert g0.abs().sum() > 0
    assert pass_through.shape == ()
    assert torch.Tensor.backward is grads._original_backward
    assert_clean(gpt2)
    gpt2.zero_grad(set_to_none=True)


def test_backward_in_a_trace_of_one_invoke(gpt2, gpt2_model):
    """One invoke is run as a trace of its input; a body with `with loss.backward():`
    still gets the gradients, warm site and all."""
    _, b = _prompts()
    want = _alone(gpt2, b)
    for _ in range(3):
        with gpt2_model.trace() as tracer:
            with tracer.invoke(b):
                h0 = gpt2_model.transformer.h[0].output
                loss = gpt2_model.lm_head.output[:, -1].logsumexp(-1).sum()
                with loss.backward():
                    g0 = h0.grad.save()
        assert torch.allclose(g0, want[0], atol=1e-6) and g0.abs().sum() > 0
        assert torch.Tensor.backward is grads._original_backward
        assert_clean(gpt2)
    gpt2.zero_grad(set_to_none=True)


def test_backward_in_the_first_invoke(gpt2, gpt2_model):
    a, b = _prompts()
    with gpt2_model.trace() as tracer:
        with tracer.invoke(a):
            h1 = gpt2_model.transformer.h[1].output
            loss = gpt2_model.lm_head.output[:, -1].logsumexp(-1).sum()
            with loss.backward():
                g1 = h1.grad.save()
        with tracer.invoke(b):
            other = gpt2_model.lm_head.output.save()
    assert torch.allclose(g1, _alone(gpt2, a, layers=(1,))[1], atol=1e-6)
    assert other.shape[0] == 1
    gpt2.zero_grad(set_to_none=True)


def test_loss_summed_across_invokes_gives_each_invoke_its_rows(gpt2, gpt2_model):
    a, b = _prompts()
    with gpt2_model.trace() as tracer:
        with tracer.invoke(a):
            ha = gpt2_model.transformer.h[0].output
            la = gpt2_model.lm_head.output[:, -1].logsumexp(-1).sum()
        with tracer.invoke(b):
            hb = gpt2_model.transformer.h[0].output
            lb = gpt2_model.lm_head.output[:, -1].logsumexp(-1).sum()
            loss = la + lb
            with loss.backward():
                gb = hb.grad.save()
                ga = ha.grad.save()
    assert torch.allclose(ga, _alone(gpt2, a, layers=(0,))[0], atol=1e-6)
    assert torch.allclose(gb, _alone(gpt2, b, layers=(0,))[0], atol=1e-6)
    assert not torch.allclose(ga, gb, atol=1e-4)
    gpt2.zero_grad(set_to_none=True)


def test_editing_grad_changes_only_that_invokes_earlier_gradients(gpt2, gpt2_model):
    a, b = _prompts()
    with gpt2_model.trace() as tracer:
        with tracer.invoke(a):
            ha0 = gpt2_model.transformer.h[0].output
            ha1 = gpt2_model.transformer.h[1].output
            la = gpt2_model.lm_head.output[:, -1].logsumexp(-1).sum()
        with tracer.invoke(b):
            hb0 = gpt2_model.transformer.h[0].output
            hb1 = gpt2_model.transformer.h[1].output
            lb = gpt2_model.lm_head.output[:, -1].logsumexp(-1).sum()
            with (la + lb).backward():
                hb1.grad = hb1.grad * 0.5      # halve what flows back, for invoke b only
                ga1 = ha1.grad.save()
                gb0 = hb0.grad.save()
                ga0 = ha0.grad.save()

    def halve(layer, grad):
        return grad * 0.5 if layer == 1 else None

    plain_a = _alone(gpt2, a)
    edited_b = _alone(gpt2, b, edit_grad=halve)
    plain_b = _alone(gpt2, b)
    assert torch.allclose(ga1, plain_a[1], atol=1e-6)
    assert torch.allclose(ga0, plain_a[0], atol=1e-6)   # invoke a is untouched
    assert torch.allclose(gb0, edited_b[0], atol=1e-6)  # invoke b sees its edit
    assert not torch.allclose(gb0, plain_b[0], atol=1e-5)
    gpt2.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def lm_gpt2():
    from tests.models.conftest import build_gpt2, build_tokenizer

    import interlace

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    module = build_gpt2(len(tokenizer), tokenizer.eos_token_id).eval()
    return interlace.LanguageModel(module, tokenizer=tokenizer), module, tokenizer


def test_different_prompt_lengths(lm_gpt2):
    model, module, tokenizer = lm_gpt2
    short, long_ = "the capital of france is", "once upon a time there was a small model"
    with model.trace() as tracer:
        with tracer.invoke(short):
            hs = model.transformer.h[0].output
            ls = model.lm_head.output[:, -1].logsumexp(-1).sum()
        with tracer.invoke(long_):
            hl = model.transformer.h[0].output
            ll = model.lm_head.output[:, -1].logsumexp(-1).sum()
            with (ls + ll).backward():
                gl = hl.grad.save()
                gs = hs.grad.save()
    for text, got in ((short, gs), (long_, gl)):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        want = _alone(module, ids, layers=(0,))[0]
        n = ids.shape[1]
        # left padding: the prompt's own positions are the last n; padding gets no gradient
        assert torch.allclose(got[:, -n:], want, atol=1e-5)
        assert torch.all(got[:, :-n] == 0)
    module.zero_grad(set_to_none=True)
