"""`envoy[i]`: integer indexing skips empty submodule slots, as iteration does."""

import pytest
import torch

import interlace


def _with_gap():
    module = torch.nn.Module()
    module.register_module("gap", None)
    module.a = torch.nn.Linear(2, 2)
    module.register_module("hole", None)
    module.b = torch.nn.Linear(2, 2)
    return module


def test_int_index_skips_empty_slots_like_iteration():
    module = _with_gap()
    model = interlace.Model(module)
    assert [e._module for e in model] == [module.a, module.b]
    assert model[0]._module is module.a
    assert model[1]._module is module.b
    assert model[-1]._module is module.b
    assert model[-2]._module is module.a
    with pytest.raises(IndexError, match=r"model has 2 submodule\(s\); index 2 is out of range"):
        model[2]


def test_int_index_without_gaps(mlp, mlp_model):
    assert [mlp_model[i]._module for i in range(-5, 5)] == list(mlp) + list(mlp)
    assert mlp_model[3] is mlp_model[3]
    with pytest.raises(IndexError, match=r"model has 5 submodule\(s\); index -6 is out of range"):
        mlp_model[-6]


def test_int_index_follows_a_slot_replaced_through_the_envoy_or_the_module():
    # `h[i]` keeps its Envoys between calls: a slot set through the Envoy (or on the module)
    # gives the new module's Envoy at once, not the one kept.
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    model = interlace.Model(layers)
    before = model[2]
    assert model[2] is before and before._module is layers[2]
    replacement = torch.nn.Linear(2, 2)
    setattr(model, "2", replacement)
    assert model[2]._module is replacement and model[2] is not before
    other = torch.nn.Linear(2, 2)
    layers[2] = other
    assert model[2]._module is other and model[-1]._module is other
    assert [e._module for e in model] == list(layers)
