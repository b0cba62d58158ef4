"""Reads and edits inside `with model.trace(...)`, each against the same thing done with hooks."""

import pytest
import torch

import interlace

from .helpers import assert_clean, hooked, logits, reference_outputs


# -- reads -------------------------------------------------------------------------------------


def test_mlp_reads_equal_plain_hooks(mlp, mlp_model, x6):
    (h0, h2), expected = reference_outputs(mlp, (x6,), [mlp[0], mlp[2]])
    with torch.no_grad(), mlp_model.trace(x6) as tracer:
        a = mlp_model[0].output.save()
        inp = mlp_model[2].input.save()
        b = mlp_model[2].output.save()
        args, kwargs = mlp_model[4].inputs
        args = interlace.save(args)
        out = mlp_model.output.save()
        result = tracer.result.save()
    assert torch.equal(a, h0) and torch.equal(b, h2)
    assert torch.equal(inp, torch.relu(h0))
    assert isinstance(args, tuple) and torch.equal(args[0], torch.tanh(h2))
    assert torch.equal(out, expected) and result is out
    assert torch.equal(tracer.result, expected)
    assert_clean(mlp)


@pytest.mark.parametrize("layer", [0, 1])
def test_gpt2_reads_equal_plain_hooks(gpt2, gpt2_model, ids, layer):
    block = gpt2.transformer.h[layer]
    (mlp_out, attn_out, block_out), expected = reference_outputs(
        gpt2, (ids,), [block.mlp, block.attn, block]
    )
    with torch.no_grad(), gpt2_model.trace(ids):
        env = gpt2_model.transformer.h[layer]
        attn = env.attn.output[0].save()
        mlp = env.mlp.output.save()
        hidden = env.output.save()
        final = gpt2_model.lm_head.output.save()
    assert torch.equal(attn, attn_out[0])
    assert torch.equal(mlp, mlp_out)
    assert torch.equal(hidden, block_out if isinstance(block_out, torch.Tensor) else block_out[0])
    assert torch.equal(final, expected.logits)
    assert_clean(gpt2)


def test_llama_keyword_only_input(llama, llama_model, ids):
    # Llama's attention is called with keywords only: .input is the first keyword argument
    seen = {}

    def pre(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)

    with torch.no_grad(), hooked(llama, pre={llama.model.layers[1].self_attn: pre}):
        llama(ids)
    assert seen["args"] == () and "hidden_states" in seen["kwargs"]
    with torch.no_grad(), llama_model.trace(ids):
        first = llama_model.model.layers[1].self_attn.input.save()
        args, kwargs = llama_model.model.layers[1].self_attn.inputs
        names = interlace.save([len(args), *kwargs])
    assert torch.equal(first, seen["kwargs"]["hidden_states"])
    assert names == [0, *seen["kwargs"]]


# -- edits ----------------------------------------------------------------------------------------


def _unedited(module, ids):
    with torch.no_grad():
        return logits(module(ids)).clone()


def test_assign_output_replaces_downstream_gpt2(gpt2, gpt2_model, ids):
    def zero(module, args, out):
        return torch.zeros_like(out)

    with torch.no_grad(), hooked(gpt2, output={gpt2.transformer.h[0].mlp: zero}):
        expected = gpt2(ids).logits
    with torch.no_grad(), gpt2_model.trace(ids) as tracer:
        gpt2_model.transformer.h[0].mlp.output = torch.zeros_like(
            gpt2_model.transformer.h[0].mlp.output
        )
        out = tracer.result.logits.save()
    assert torch.equal(out, expected)
    assert not torch.allclose(out, _unedited(gpt2, ids))
    assert_clean(gpt2)


def test_in_place_edit_seen_downstream_gpt2(gpt2, gpt2_model, ids):
    def edit(module, args, out):
        out[:, 0] = 0

    with torch.no_grad(), hooked(gpt2, output={gpt2.transformer.h[1].mlp: edit}):
        expected = gpt2(ids).logits
    with torch.no_grad(), gpt2_model.trace(ids):
        gpt2_model.transformer.h[1].mlp.output[:, 0] = 0
        out = gpt2_model.lm_head.output.save()
    assert torch.equal(out, expected)
    assert not torch.allclose(out, _unedited(gpt2, ids))


def test_edit_llama_every_mlp(llama, llama_model, ids):
    def halve(module, args, out):
        return out * 0.5

    layers = llama.model.layers
    with torch.no_grad(), hooked(llama, output={layer.mlp: halve for layer in layers}):
        expected = llama(ids).logits
    with torch.no_grad(), llama_model.trace(ids):
        for layer in llama_model.model.layers:
            layer.mlp.output = layer.mlp.output * 0.5
        out = llama_model.output.logits.save()
    assert torch.equal(out, expected)
    assert not torch.allclose(out, _unedited(llama, ids))


def test_assign_input_and_inputs(mlp, mlp_model, x6):
    with torch.no_grad():
        h = torch.tanh(mlp[2](torch.relu(mlp[0](x6))))
        expected_input = mlp[4](h * 2)
        expected_inputs = mlp[4](h + 1)
    with torch.no_grad(), mlp_model.trace(x6):
        mlp_model[4].input = mlp_model[4].input * 2
        out = mlp_model.output.save()
    assert torch.equal(out, expected_input)
    with torch.no_grad(), mlp_model.trace(x6):
        (a,), kw = mlp_model[4].inputs
        mlp_model[4].inputs = ((a + 1,), kw)
        out = mlp_model.output.save()
    assert torch.equal(out, expected_inputs)
    assert not torch.allclose(expected_input, mlp(x6))


def test_assign_llama_keyword_input(llama, llama_model, ids):
    layer = llama.model.layers[0]

    def pre(module, args, kwargs):
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = kwargs["hidden_states"] * 0
        return args, kwargs

    with torch.no_grad(), hooked(llama, pre={layer.self_attn: pre}):
        expected = llama(ids).logits
    with torch.no_grad(), llama_model.trace(ids):
        attn = llama_model.model.layers[0].self_attn
        attn.input = attn.input * 0
        out = llama_model.output.logits.save()
    assert torch.equal(out, expected)
    assert not torch.allclose(out, _unedited(llama, ids))


def test_bad_inputs_assignment(mlp_model, x6):
    with pytest.raises(TypeError, match=r"model\.2\.inputs must be assigned a pair \(args, kwargs\)"):
        with mlp_model.trace(x6):
            mlp_model[2].inputs = 5


# -- skip, stop, plain calls ---------------------------------------------------------------------


def test_skip_uses_value_and_does_not_run(mlp, mlp_model, x6):
    calls = []
    handle = mlp[2].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad(), mlp_model.trace(x6):
            mlp_model[2].skip(torch.ones(3, 16))
            seen = mlp_model[2].output.save()
            out = mlp_model.output.save()
    finally:
        handle.remove()
    assert torch.equal(seen, torch.ones(3, 16))
    with torch.no_grad():
        assert torch.equal(out, mlp[4](torch.tanh(torch.ones(3, 16))))
    assert calls == [1]  # the call happened (pre-hooks fire) but the forward did not run
    assert_clean(mlp)


def test_skip_gpt2_block_equals_identity_hook(gpt2, gpt2_model, ids):
    def identity(module, args, out):
        return args[0]

    with torch.no_grad(), hooked(gpt2, output={gpt2.transformer.h[1]: identity}):
        expected = gpt2(ids).logits
    with torch.no_grad(), gpt2_model.trace(ids):
        block = gpt2_model.transformer.h[1]
        block.skip(block.input)
        out = gpt2_model.lm_head.output.save()
    assert torch.equal(out, expected)
    assert not torch.allclose(out, _unedited(gpt2, ids))
    assert_clean(gpt2)


def test_stop_ends_forward_and_keeps_saves(mlp, mlp_model, x6):
    ran = []
    handle = mlp[4].register_forward_hook(lambda *a: ran.append(1))
    try:
        with torch.no_grad(), mlp_model.trace(x6) as tracer:
            h = mlp_model[0].output.save()
            tracer.stop()
            after = 1  # noqa: F841 - must not run
    finally:
        handle.remove()
    assert ran == []
    assert torch.equal(h, mlp[0](x6).detach())
    assert "after" not in locals()
    assert_clean(mlp)


def test_submodule_called_inside_trace_runs_plain(gpt2, gpt2_model, ids):
    with torch.no_grad():
        hidden = gpt2.transformer(ids).last_hidden_state
        expected = gpt2.lm_head(hidden)
    with torch.no_grad(), gpt2_model.trace(ids):
        h = gpt2_model.transformer.ln_f.output
        direct = gpt2_model.lm_head(h).save()
        # the direct call fired no hook: lm_head's occurrence 0 is still the model's own call
        real = gpt2_model.lm_head.output.save()
    assert torch.equal(direct, expected)
    assert torch.equal(real, expected)


# -- save, modes ---------------------------------------------------------------------------------


def test_unsaved_values_are_not_pushed(mlp_model, x6):
    def run():
        with mlp_model.trace(x6):
            kept = mlp_model[0].output.save()
            dropped = mlp_model[2].output  # noqa: F841
        return kept, dropped  # noqa: F821

    with pytest.raises(UnboundLocalError, match="dropped"):
        run()


def test_body_runs_under_callers_no_grad(mlp, mlp_model, x6):
    with torch.no_grad(), mlp_model.trace(x6):
        h = mlp_model[0].output.save()
        grad_in_body = interlace.save([torch.is_grad_enabled()])
    assert grad_in_body == [False] and not h.requires_grad
    with mlp_model.trace(x6):
        h = mlp_model[0].output.save()
        grad_in_body = interlace.save([torch.is_grad_enabled()])
    assert grad_in_body == [True] and h.requires_grad


def test_body_mode_changes_do_not_leak_into_forward(mlp, mlp_model, x6):
    seen = []
    handle = mlp[4].register_forward_hook(lambda m, a, o: seen.append(torch.is_grad_enabled()))
    try:
        with mlp_model.trace(x6):
            with torch.no_grad():
                h = mlp_model[0].output  # parks inside the body's no_grad
            torch.set_grad_enabled(False)
            h2 = mlp_model[2].output.save()  # parks with grad disabled in the body
            out = mlp_model.output.save()
    finally:
        handle.remove()
    assert seen == [True] and out.requires_grad and h2.requires_grad
    assert torch.is_grad_enabled()



def test_occurrences_of_a_module_used_twice():
    torch.manual_seed(0)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(torch.relu(self.lin(x)))

    module = Twice().eval()
    model = interlace.Model(module)
    x = torch.randn(2, 4)
    seen = []
    with torch.no_grad(), hooked(module, output={module.lin: lambda m, a, o: seen.append(o.clone())}):
        module(x)
    for _ in range(2):  # the first trace learns the order, the second derives from it
        with torch.no_grad(), model.trace(x) as tracer:
            first = model.lin.output.save()
        assert torch.equal(first, seen[0])
        with torch.no_grad(), model.trace(x):
            model.lin.input  # occurrence 0
            tracer_ptr = model._active().mediator().pointer
            tracer_ptr.pin(1)
            second = model.lin.output.save()
        assert torch.equal(second, seen[1])


def test_pass_only_body_still_runs_the_model(mlp, mlp_model, x6):
    with torch.no_grad(), mlp_model.trace(x6) as tracer:
        pass
    assert torch.equal(tracer.result, mlp(x6).detach())


def test_body_runs_under_callers_inference_mode(mlp, mlp_model, x6):
    with torch.inference_mode(), mlp_model.trace(x6):
        h = mlp_model[0].output.save()
        flags = interlace.save([torch.is_inference_mode_enabled()])
    assert flags == [True] and h.is_inference()


def test_trace_of_another_model_inside_a_body(mlp, mlp_model, gpt2, gpt2_model, x6, ids):
    with torch.no_grad(), gpt2_model.trace(ids):
        logits = gpt2_model.lm_head.output.save()
        with mlp_model.trace(x6):
            inner = mlp_model[0].output.save()
    with torch.no_grad():
        assert torch.equal(inner, mlp[0](x6))
        assert torch.equal(logits, gpt2(ids).logits)
    assert_clean(mlp)
    assert_clean(gpt2)


def test_tracer_result_outside_before_run(mlp_model, x6):
    tracer = mlp_model.trace(x6)
    with pytest.raises(interlace.InterlaceError, match="tracer.result is the model's return value"):
        tracer.result
