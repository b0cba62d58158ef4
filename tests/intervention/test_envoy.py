"""The Envoy tree, and a wrapped model outside any trace being exactly the module."""

import pytest
import torch

import interlace
from interlace import InterlaceError

from .helpers import assert_clean, logits


def test_tree_mirrors_submodules(gpt2, gpt2_model):
    mlp = gpt2_model.transformer.h[0].mlp
    assert isinstance(mlp, interlace.Envoy)
    assert mlp._module is gpt2.transformer.h[0].mlp
    assert mlp._path == "model.transformer.h.0.mlp"
    # the same Envoy object each time (cached), and index == attribute
    assert gpt2_model.transformer.h[1] is gpt2_model.transformer.h[1]
    assert gpt2_model.transformer.h[-1]._module is gpt2.transformer.h[1]


def test_modulelist_and_sequential_index_iterate_len(mlp, mlp_model, gpt2, gpt2_model):
    assert len(gpt2_model.transformer.h) == 2
    assert [e._module for e in gpt2_model.transformer.h] == list(gpt2.transformer.h)
    assert len(mlp_model) == 5
    assert [e._module for e in mlp_model] == list(mlp)
    assert [e._module for e in mlp_model[1:3]] == [mlp[1], mlp[2]]
    assert mlp_model["4"]._module is mlp[4]
    with pytest.raises(IndexError, match=r"model has 5 submodule\(s\); index 7 is out of range"):
        mlp_model[7]
    with pytest.raises(KeyError, match="model has no submodule 'x'"):
        mlp_model["x"]


def test_attributes_fall_through(gpt2, gpt2_model):
    assert gpt2_model.config is gpt2.config
    assert gpt2_model.transformer.h[0].mlp.c_fc.weight is gpt2.transformer.h[0].mlp.c_fc.weight
    assert gpt2_model.training is gpt2.training


def test_an_envoy_is_always_truthy(gpt2, gpt2_model):
    """A leaf has no children: without __bool__, bool() would fall back to len() == 0."""
    leaf = gpt2_model.transformer.h[0].mlp.c_fc
    assert len(leaf) == 0 and len(gpt2.transformer.h[0].mlp.c_fc._modules) == 0
    assert bool(leaf) is True
    taken = "then" if leaf else "else"
    assert taken == "then"
    assert all(bool(e) for e in (gpt2_model, gpt2_model.transformer.h, gpt2_model.lm_head))


def test_a_child_held_alone_keeps_working(gpt2, ids):
    """`layer = model.transformer.h[0]`, then the wrapper is dropped: the child still works
    (it holds its module and the model's state, not its root)."""
    model = interlace.Model(gpt2)
    layer = model.transformer.h[0]
    del model
    assert layer.mlp._module is gpt2.transformer.h[0].mlp
    assert layer.mlp._path == "model.transformer.h.0.mlp"
    with pytest.raises(InterlaceError, match=r"model\.transformer\.h\.0\.output is only available "
                                             r"inside a `with model\.trace\(\.\.\.\)` block"):
        layer.output  # noqa: B018
    with torch.no_grad():
        torch.testing.assert_close(layer(gpt2.transformer.wte(ids)), gpt2.transformer.h[0](gpt2.transformer.wte(ids)))


def test_missing_submodule_lists_children(gpt2_model):
    with pytest.raises(AttributeError) as info:
        gpt2_model.transformer.h[0].mlpp
    message = str(info.value)
    assert "model.transformer.h.0 (GPT2Block) has no submodule or attribute 'mlpp'" in message
    assert "ln_1, attn, ln_2, mlp" in message


def test_print_shows_the_tree(gpt2, gpt2_model):
    text = repr(gpt2_model)
    assert text == repr(gpt2)
    assert "(mlp): GPT2MLP(" in text
    assert repr(gpt2_model.transformer.h[0].mlp).startswith("GPT2MLP(")


def test_nnsight_alias():
    assert interlace.NNsight is interlace.Model


def test_model_refuses_non_modules():
    with pytest.raises(TypeError, match="Model wraps a torch.nn.Module, got str"):
        interlace.Model("gpt2")


def test_outside_a_trace_the_model_is_the_plain_module(gpt2, ids):
    # structurally: wrapping installs nothing, and the class's forward is what runs
    model = interlace.Model(gpt2)
    assert_clean(gpt2)
    for _, sub in gpt2.named_modules():
        assert type(sub).forward is sub.forward.__func__
    with torch.no_grad():
        expected = gpt2(ids).logits
        got = model(ids).logits
    assert torch.equal(got, expected)
    with model.trace(ids):
        model.transformer.h[0].output.save()
    assert_clean(gpt2)


def test_values_outside_a_trace_are_an_error(mlp_model):
    with pytest.raises(InterlaceError, match=r"model\.2\.output is only available inside a "
                                             r"`with model.trace\(\.\.\.\)` block"):
        mlp_model[2].output
    with pytest.raises(InterlaceError, match=r"model\.2\.input is only available"):
        mlp_model[2].input = torch.zeros(1)


def test_calling_the_wrapper_runs_the_module(mlp, mlp_model, x6):
    with torch.no_grad():
        assert torch.equal(mlp_model(x6), mlp(x6))
        assert torch.equal(mlp_model[0](x6), mlp[0](x6))
        assert torch.equal(logits(mlp_model(x6)), mlp(x6))
