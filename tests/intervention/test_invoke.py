"""Several `tracer.invoke(...)` blocks in one forward pass, each with only its own rows."""

import pytest
import torch

from interlace import InterlaceError
from interlace.intervention.batching import BatchingError

from .helpers import assert_clean, hooked


def test_invokes_equal_separate_runs_mlp(mlp, mlp_model):
    x1 = torch.randn(1, 6, generator=torch.Generator().manual_seed(3))
    x2 = torch.randn(2, 6, generator=torch.Generator().manual_seed(4))
    calls = []
    handle = mlp.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    try:
        with torch.no_grad(), mlp_model.trace() as tracer:
            with tracer.invoke(x1):
                a = mlp_model[2].output.save()
                out1 = mlp_model.output.save()
            with tracer.invoke(x2):
                b = mlp_model[2].output.save()
                out2 = mlp_model.output.save()
    finally:
        handle.remove()
    assert calls == [3]  # one forward pass over the batch of 1 + 2 rows
    with torch.no_grad():
        assert torch.allclose(a, mlp[:3](x1), atol=1e-6) and a.shape == (1, 16)
        assert torch.allclose(b, mlp[:3](x2), atol=1e-6) and b.shape == (2, 16)
        assert torch.allclose(out1, mlp(x1), atol=1e-6)
        assert torch.allclose(out2, mlp(x2), atol=1e-6)
    assert tracer.result.shape == (3, 4)
    assert_clean(mlp)


def test_each_invoke_edits_only_its_rows_gpt2(gpt2, gpt2_model):
    g = torch.Generator().manual_seed(5)
    p1 = torch.randint(0, 1000, (1, 10), generator=g)
    p2 = torch.randint(0, 1000, (1, 10), generator=g)
    mlp = gpt2.transformer.h[0].mlp

    def zero(module, args, out):
        return torch.zeros_like(out)

    with torch.no_grad():
        plain2 = gpt2(p2).logits
        with hooked(gpt2, output={mlp: zero}):
            edited1 = gpt2(p1).logits
    with torch.no_grad(), gpt2_model.trace() as tracer:
        with tracer.invoke(p1):
            gpt2_model.transformer.h[0].mlp.output = torch.zeros_like(
                gpt2_model.transformer.h[0].mlp.output
            )
            l1 = gpt2_model.lm_head.output.save()
        with tracer.invoke(p2):
            # reads of invoke 2 are its own rows, unaffected by invoke 1's edit
            h2 = gpt2_model.transformer.h[0].mlp.output.save()
            l2 = gpt2_model.lm_head.output.save()
    assert torch.allclose(l1, edited1, atol=1e-5)
    assert torch.allclose(l2, plain2, atol=1e-5)
    assert not torch.allclose(l1, gpt2(p1).logits.detach(), atol=1e-3)
    assert h2.shape == (1, 10, 64) and h2.abs().sum() > 0


def test_in_place_edit_in_one_invoke(mlp, mlp_model):
    x1, x2 = torch.ones(1, 6), torch.full((1, 6), 2.0)
    with torch.no_grad(), mlp_model.trace() as tracer:
        with tracer.invoke(x1):
            mlp_model[2].output[:] = 0
        with tracer.invoke(x2):
            pass
    with torch.no_grad():
        assert torch.allclose(tracer.result[0], mlp[4](torch.zeros(16)), atol=1e-6)
        assert torch.allclose(tracer.result[1:], mlp(x2), atol=1e-6)


def test_invokes_of_the_very_same_input_each_edit_only_their_rows(mlp, mlp_model):
    """Three invokes pass the same tensor object (its inputs are prepared once for all of
    them): each still gets rows of its own, an in-place edit in one reaches no other, and the
    caller's tensor is left as it was."""
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(7))
    before = x.clone()
    with torch.no_grad(), mlp_model.trace() as tracer:
        with tracer.invoke(x):
            mlp_model[2].output[:] = 0
        with tracer.invoke(x):
            h = mlp_model[2].output.clone().save()
        with tracer.invoke(x):
            mlp_model[2].output[:, 0] += 1
    with torch.no_grad():
        plain = mlp(x)
        with hooked(mlp, output={mlp[2]: lambda m, a, out: out * 0}):
            zeroed = mlp(x)

        def bump(module, args, out):
            out = out.clone()
            out[:, 0] += 1
            return out

        with hooked(mlp, output={mlp[2]: bump}):
            bumped = mlp(x)
        assert torch.allclose(h, mlp[:3](x), atol=1e-6)
    assert tracer.result.shape == (6, 4)
    assert torch.allclose(tracer.result[0:2], zeroed, atol=1e-6)
    assert torch.allclose(tracer.result[2:4], plain, atol=1e-6)
    assert torch.allclose(tracer.result[4:6], bumped, atol=1e-6)
    assert torch.equal(x, before)


def test_inputs_that_cannot_be_batched(mlp_model):
    with pytest.raises(BatchingError, match=r"positional argument 0 is a tensor of shape \(1, 6\) "
                                            r"and dtype torch.float32 in invoke 0 but a tensor of "
                                            r"shape \(1, 5\) and dtype torch.float32 in invoke 1"):
        with mlp_model.trace() as tracer:
            with tracer.invoke(torch.ones(1, 6)):
                pass
            with tracer.invoke(torch.ones(1, 5)):
                pass
    with pytest.raises(BatchingError, match="invoke 0 passes 1 positional argument"):
        with mlp_model.trace() as tracer:
            with tracer.invoke(torch.ones(1, 6)):
                pass
            with tracer.invoke(input=torch.ones(1, 6)):
                pass
    assert issubclass(BatchingError, InterlaceError)


def test_invoke_needs_a_trace_without_inputs(mlp_model):
    with pytest.raises(InterlaceError, match=r"this trace already has inputs \(model.trace\(x\)\)"):
        with mlp_model.trace(torch.ones(1, 6)) as tracer:
            with tracer.invoke(torch.ones(1, 6)):
                pass


def test_module_values_outside_invokes(mlp_model):
    with pytest.raises(InterlaceError, match=r"model\.0\.output was used outside an invoke"):
        with mlp_model.trace() as tracer:
            with tracer.invoke(torch.ones(1, 6)):
                pass
            mlp_model[0].output.save()


def test_trace_without_inputs_or_invokes_runs_nothing(mlp, mlp_model):
    calls = []
    handle = mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with mlp_model.trace():
            x = 1  # noqa: F841
    finally:
        handle.remove()
    assert calls == []


def test_skip_in_one_invoke_replaces_only_its_rows(mlp, mlp_model):
    x1, x2 = torch.ones(1, 6), torch.full((2, 6), 2.0)
    with torch.no_grad(), mlp_model.trace() as tracer:
        with tracer.invoke(x1):
            mlp_model[2].skip(torch.full((1, 16), 0.5))
            out1 = mlp_model.output.save()
        with tracer.invoke(x2):
            out2 = mlp_model.output.save()
    with torch.no_grad():
        assert torch.allclose(out1, mlp[4](torch.tanh(torch.full((1, 16), 0.5))), atol=1e-6)
        assert torch.allclose(out2, mlp(x2), atol=1e-6)
    assert_clean(mlp)


def test_stop_in_an_invoke_keeps_every_invokes_saves(mlp, mlp_model):
    x1, x2 = torch.ones(1, 6), torch.full((1, 6), 2.0)
    with torch.no_grad(), mlp_model.trace() as tracer:
        with tracer.invoke(x1):
            a = mlp_model[0].output.save()
        with tracer.invoke(x2):
            b = mlp_model[0].output.save()
            tracer.stop()
            never = 1  # noqa: F841
    with torch.no_grad():
        assert torch.allclose(a, mlp[0](x1)) and torch.allclose(b, mlp[0](x2))
    assert "never" not in locals()
    assert_clean(mlp)


def test_activation_patching_across_invokes_equals_hooks(gpt2, gpt2_model):
    g = torch.Generator().manual_seed(11)
    clean = torch.randint(0, 1000, (1, 8), generator=g)
    corrupt = torch.randint(0, 1000, (1, 8), generator=g)
    block = gpt2.transformer.h[0]
    stash = {}

    def grab(module, args, out):
        stash["h"] = out[:, 3].clone()

    def patch(module, args, out):
        out = out.clone()
        out[:, 3] = stash["h"]
        return out

    with torch.no_grad():
        with hooked(gpt2, output={block: grab}):
            gpt2(clean)
        with hooked(gpt2, output={block: patch}):
            expected = gpt2(corrupt).logits
        unpatched = gpt2(corrupt).logits
    with torch.no_grad(), gpt2_model.trace() as tracer:
        with tracer.invoke(clean):
            h = gpt2_model.transformer.h[0].output[:, 3].save()
        with tracer.invoke(corrupt):
            # `h` is read before the request: the body waits for invoke 0 to assign it,
            # then edits the same layer of its own row
            gpt2_model.transformer.h[0].output[:, 3] = h
            patched = gpt2_model.lm_head.output.save()
    assert torch.allclose(h, stash["h"], atol=1e-6)
    assert torch.allclose(patched, expected, atol=1e-5)
    assert not torch.allclose(patched, unpatched, atol=1e-3)
    assert_clean(gpt2)


def test_later_invoke_reads_an_earlier_invokes_variable(mlp, mlp_model):
    x1, x2 = torch.ones(1, 6), torch.full((1, 6), 2.0)
    with torch.no_grad(), mlp_model.trace() as tracer:
        with tracer.invoke(x1):
            first = mlp_model[0].output
        with tracer.invoke(x2):
            out = mlp_model.output
            total = (out.sum() + first.sum()).save()
    with torch.no_grad():
        assert torch.allclose(total, mlp(x2).sum() + mlp[0](x1).sum(), atol=1e-5)


def test_name_no_invoke_assigns_is_a_name_error(mlp_model):
    with pytest.raises(NameError, match="name 'nowhere' is not defined"):
        with mlp_model.trace() as tracer:
            with tracer.invoke(torch.ones(1, 6)):
                a = 1  # noqa: F841
            with tracer.invoke(torch.ones(1, 6)):
                b = nowhere + 1  # noqa: F821, F841


def test_name_an_earlier_invoke_never_gets_to(mlp, mlp_model):
    with pytest.raises(NameError, match="name 'late' is not defined: no earlier invoke assigned "
                                        "it before it ended"):
        with torch.no_grad(), mlp_model.trace() as tracer:
            with tracer.invoke(torch.ones(1, 6)):
                mlp_model[0].output
                if False:
                    late = 1  # noqa: F841
            with tracer.invoke(torch.ones(1, 6)):
                b = late + 1  # noqa: F841
    assert_clean(mlp)
