"""Invokes bind the caller's names where their `with` stands (the batching rule).

An invoke's body behaves as if it ran inline at the point of its `with tracer.invoke(...)`:
a loop variable has that iteration's value, a caller's list is the same list, a variable an
earlier invoke assigns is read from that earlier body (the latest one), and invokes served
at one location run in invoke order. Every test compares the batched trace with one trace
per invoke (or with the same Python run inline), never with interlace's own output.
"""

import pytest
import torch

import interlace

from .helpers import assert_clean

SEQ = 8


@pytest.fixture
def prompt():
    return torch.randint(0, 1000, (1, SEQ), generator=torch.Generator().manual_seed(5))


def _alone(model, ids, edit):
    """One trace of `ids` with `edit(model)` applied in its body; the last-position logit 0."""
    with torch.no_grad(), model.trace(ids):
        edit(model)
        value = model.output.logits[0, -1, :4].save()
    return value


def test_loop_over_positions_sees_each_iteration(gpt2, gpt2_model, prompt):
    res = []
    with torch.no_grad(), gpt2_model.trace() as tracer:
        for p in range(3):
            with tracer.invoke(prompt):
                gpt2_model.transformer.h[0].output[:, p] = 0
                res.append(gpt2_model.output.logits[0, -1, :4])
        res = interlace.save(res)

    def zero_at(p):
        def edit(model):
            model.transformer.h[0].output[:, p] = 0
        return edit

    expected = [_alone(gpt2_model, prompt, zero_at(p)) for p in range(3)]
    assert len(res) == 3
    for got, want in zip(res, expected):
        assert torch.equal(got, want)
    # not vacuous: the three positions give three different results
    assert not torch.allclose(expected[0], expected[1], atol=1e-6)
    assert not torch.allclose(expected[1], expected[2], atol=1e-6)
    assert_clean(gpt2)


def test_loop_over_layers_hooks_a_different_module_per_invoke(gpt2, gpt2_model, prompt):
    out = {}
    with torch.no_grad(), gpt2_model.trace() as tracer:
        for layer in range(2):
            with tracer.invoke(prompt):
                gpt2_model.transformer.h[layer].mlp.output[:] = 0
                out[layer] = gpt2_model.lm_head.output[0, -1, :4]
        out = interlace.save(out)

    def zero_mlp(layer):
        def edit(model):
            model.transformer.h[layer].mlp.output[:] = 0
        return edit

    for layer in range(2):
        assert torch.equal(out[layer], _alone(gpt2_model, prompt, zero_mlp(layer)))
    assert not torch.allclose(out[0], out[1], atol=1e-6)
    assert_clean(gpt2)


def test_nested_loops_with_a_comprehension_in_the_body(gpt2_model, prompt):
    got = []
    with torch.no_grad(), gpt2_model.trace() as tracer:
        for layer in range(2):
            for p in (1, 4):
                with tracer.invoke(prompt):
                    h = gpt2_model.transformer.h[layer].output
                    h[:, p] = 0
                    # a comprehension reads the loop variables through its own scope
                    got.append([gpt2_model.lm_head.output[0, -1, k] for k in range(p, p + 2)])
        got = interlace.save(got)

    expected = []
    for layer in range(2):
        for p in (1, 4):
            with torch.no_grad(), gpt2_model.trace(prompt):
                gpt2_model.transformer.h[layer].output[:, p] = 0
                logits = gpt2_model.lm_head.output[0, -1].save()
            expected.append([logits[k] for k in range(p, p + 2)])
    assert len(got) == 4
    for row, want in zip(got, expected):
        assert torch.equal(torch.stack(row), torch.stack(want))
    assert not torch.equal(torch.stack(got[0]), torch.stack(got[2]))


def test_the_callers_list_is_the_same_object_and_appends_land_in_invoke_order(gpt2_model, prompt):
    order = []
    seen = []
    with torch.no_grad(), gpt2_model.trace() as tracer:
        for i in range(3):
            with tracer.invoke(prompt):
                if i == 0:
                    # invoke 0 first waits at layer 0, so invoke 1 and 2 park at layer 1 before it
                    gpt2_model.transformer.h[0].output
                gpt2_model.transformer.h[1].output
                order.append(i)
                seen.append(order)
        seen = interlace.save(seen)
    assert order == [0, 1, 2]
    assert all(s is order for s in seen)


def test_a_later_invoke_reads_the_latest_earlier_invokes_variable(gpt2_model, prompt):
    with torch.no_grad(), gpt2_model.trace() as tracer:
        for p in range(3):
            with tracer.invoke(prompt):
                h = gpt2_model.transformer.h[0].output[:, p]
        with tracer.invoke(prompt):
            mine = gpt2_model.transformer.h[0].output[:, 2]
            diff = (mine - h).abs().max().save()
            other = h.save()
    with torch.no_grad(), gpt2_model.trace(prompt):
        want = gpt2_model.transformer.h[0].output[:, 2].save()
    assert diff.item() == 0.0
    assert torch.equal(other, want)


def test_an_earlier_invoke_wins_over_the_callers_older_value(mlp, mlp_model):
    x1, x2 = torch.ones(1, 6), torch.full((1, 6), 2.0)
    with torch.no_grad(), mlp_model.trace() as tracer:
        first = "the caller's value, overwritten inline by invoke 0"
        with tracer.invoke(x1):
            first = mlp_model[0].output
        with tracer.invoke(x2):
            total = (first.sum() + 0).save()
    with torch.no_grad():
        assert torch.allclose(total, mlp[0](x1).sum())


def test_the_callers_value_applies_when_no_earlier_invoke_binds_the_name(mlp, mlp_model):
    scale = 3.0
    with torch.no_grad(), mlp_model.trace() as tracer:
        with tracer.invoke(torch.ones(1, 6)):
            if False:
                scale = 100.0  # an earlier invoke that assigns it, but never does
            mlp_model[0].output
        with tracer.invoke(torch.ones(1, 6)):
            out = (mlp_model.output * scale).save()
    with torch.no_grad():
        assert torch.allclose(out, mlp(torch.ones(1, 6)) * 3.0)


def test_trace_code_after_an_invoke_does_not_see_its_variables_yet(mlp_model):
    """As in nnsight 0.8.1: the trace body runs before the model does, collecting invokes."""
    seen = {}
    with torch.no_grad(), mlp_model.trace() as tracer:
        with tracer.invoke(torch.ones(1, 6)):
            h = mlp_model[0].output.save()
        try:
            h  # noqa: B018
            seen["h"] = "bound"
        except NameError:
            seen["h"] = "not yet"
        seen = interlace.save(seen)
    assert seen == {"h": "not yet"}
    assert h.shape == (1, 16)  # after the block, saved values come back as usual


@pytest.mark.slow  # starts a subprocess
def test_module_level_loop(tmp_path):
    """The same rule at module level (the body's names are globals there)."""
    import subprocess
    import sys

    script = tmp_path / "loop.py"
    script.write_text(
        "import torch, interlace\n"
        "torch.manual_seed(0)\n"
        "net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "model = interlace.Model(net)\n"
        "x = torch.randn(1, 4)\n"
        "res = []\n"
        "with torch.no_grad(), model.trace() as tr:\n"
        "    for p in range(3):\n"
        "        with tr.invoke(x):\n"
        "            model[0].output[:, p] = 0\n"
        "            res.append(model.output)\n"
        "    res = interlace.save(res)\n"
        "for p in range(3):\n"
        "    with torch.no_grad(), model.trace(x):\n"
        "        model[0].output[:, p] = 0\n"
        "        one = model.output.save()\n"
        "    assert torch.allclose(one, res[p], atol=1e-6), (p, one, res[p])\n"
        "assert not torch.allclose(res[0], res[1], atol=1e-4)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
