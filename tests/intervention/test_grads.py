"""Gradients inside a trace: `with loss.backward():` then `h.grad`, against torch.autograd."""

import pytest
import torch

import interlace
from interlace import OutOfOrderError
from interlace.intervention import grads

from .helpers import assert_clean


def _patches_gone():
    assert torch.Tensor.backward is grads._original_backward
    assert "grad" not in torch.Tensor.__dict__


def test_grads_equal_autograd_mlp(mlp, mlp_model, x6):
    with mlp_model.trace(x6):
        h0 = mlp_model[0].output
        h2 = mlp_model[2].output
        loss = mlp_model.output.sum()
        with loss.backward():
            g2 = h2.grad.save()
            g0 = h0.grad.save()
    h0 = mlp[0](x6)
    h2 = mlp[2](mlp[1](h0))
    r2, r0 = torch.autograd.grad(mlp[4](mlp[3](h2)).sum(), [h2, h0])
    assert torch.allclose(g2, r2) and torch.allclose(g0, r0)
    _patches_gone()
    assert_clean(mlp)
    mlp.zero_grad(set_to_none=True)


def test_grads_gpt2_layers(gpt2, gpt2_model, ids):
    with gpt2_model.trace(ids):
        h0 = gpt2_model.transformer.h[0].output
        h1 = gpt2_model.transformer.h[1].output
        loss = gpt2_model.lm_head.output.logsumexp(-1).mean()
        with loss.backward():
            g1 = h1.grad.save()
            g0 = h0.grad.save()
    seen = {}

    def keep(i):
        def hook(module, args, out):
            seen[i] = out

        return hook

    handles = [gpt2.transformer.h[i].register_forward_hook(keep(i)) for i in range(2)]
    try:
        loss = gpt2(ids).logits.logsumexp(-1).mean()
    finally:
        for handle in handles:
            handle.remove()
    r1, r0 = torch.autograd.grad(loss, [seen[1], seen[0]])
    assert torch.allclose(g1, r1, atol=1e-6) and torch.allclose(g0, r0, atol=1e-6)
    gpt2.zero_grad(set_to_none=True)


def test_assigning_grad_changes_what_flows_back(mlp, mlp_model, x6):
    with mlp_model.trace(x6):
        h0 = mlp_model[0].output
        h2 = mlp_model[2].output
        loss = mlp_model.output.sum()
        with loss.backward():
            h2.grad = h2.grad * 0.5
            g0 = h0.grad.save()
    # the same edit with a plain tensor hook
    h0 = mlp[0](x6)
    h2 = mlp[2](mlp[1](h0))
    h2.register_hook(lambda g: g * 0.5)
    (r0,) = torch.autograd.grad(mlp[4](mlp[3](h2)).sum(), [h0])
    assert torch.allclose(g0, r0)
    h0c = mlp[0](x6)
    (unedited,) = torch.autograd.grad(mlp[4](mlp[3](mlp[2](mlp[1](h0c)))).sum(), [h0c])
    assert not torch.allclose(g0, unedited)
    mlp.zero_grad(set_to_none=True)


def test_grad_requested_in_an_order_backward_cannot_supply(mlp, mlp_model, x6):
    with pytest.raises(OutOfOrderError, match=r"\.grad of a tensor of shape \(3, 16\) was never "
                                              r"supplied: backward had already passed it"):
        with mlp_model.trace(x6):
            h0 = mlp_model[0].output
            h2 = mlp_model[2].output
            loss = mlp_model.output.sum()
            with loss.backward():
                g0 = h0.grad.save()  # noqa: F841 - arrives after h2's
                g2 = h2.grad.save()  # noqa: F841 - already passed
    _patches_gone()
    assert_clean(mlp)
    mlp.zero_grad(set_to_none=True)


def test_plain_backward_inside_a_trace_is_torchs(mlp, mlp_model, x6):
    mlp.zero_grad(set_to_none=True)
    with mlp_model.trace(x6):
        mlp_model.output.sum().backward()
    got = mlp[0].weight.grad.clone()
    mlp.zero_grad(set_to_none=True)
    mlp(x6).sum().backward()
    assert torch.allclose(got, mlp[0].weight.grad)
    mlp.zero_grad(set_to_none=True)
    _patches_gone()


def test_grad_of_a_tensor_without_grad(mlp_model, x6):
    with pytest.raises(interlace.InterlaceError, match="that does not require grad"):
        with mlp_model.trace(x6):
            h0 = mlp_model[0].output.detach()
            loss = mlp_model.output.sum()
            with loss.backward():
                h0.grad
    _patches_gone()


def test_the_backward_check_does_not_keep_blocks_alive():
    """The per-Block answer goes with the Block (which holds the caller's globals)."""
    import ast
    import gc
    import weakref

    from interlace.intervention import grads

    class FakeBlock:  # what block_uses_backward reads of a Block
        def __init__(self, source):
            self.statements = ast.parse(source).body

    uses = FakeBlock("with loss.backward():\n    g = x.grad\n")
    plain = FakeBlock("y = x + 1\n")
    assert grads.block_uses_backward(uses) is True
    assert grads.block_uses_backward(plain) is False
    assert grads.block_uses_backward(uses) is True  # from the cache
    gone = weakref.ref(uses)
    del uses
    gc.collect()
    assert gone() is None
