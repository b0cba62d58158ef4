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
