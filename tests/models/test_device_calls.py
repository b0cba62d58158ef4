"""A trace asks torch for nothing that the same plain hooks do not.

On a GPU a small model's forward is bound by the host launching kernels, so an operator a
trace added (a copy, a clone, above all a synchronisation such as `bool(tensor)` or `.item()`,
which stops the host until the device has caught up) would cost far more there than its
instructions say. Counted here with a `TorchDispatchMode`, which sees every operator the model
and the body run: the common traces (save a block's output; zero every MLP and save the
logits) dispatch exactly the operators of plain forward hooks doing the same on the same
model, and give the same values. (`benchmarks/probes/device_calls.py` counts the same on a
GPU, with the CUDA runtime's calls.)
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import layers

import interlace

pytestmark = pytest.mark.torch


class _Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _operators(run):
    """(operator -> count, value) of one warm call of `run`."""
    with torch.no_grad():
        run()
        run()
        with _Operators() as mode:
            value = run()
    return mode.counts, value


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _with_hooks(module, hooks, ids):
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        module(ids)
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture(scope="module")
def model_and_module(model_dir):
    """A fresh copy of the weights (the wrapper's module), and interlace.Model of it."""
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return interlace.Model(module), module


IDS = torch.tensor([[5, 9, 2, 7, 3, 8, 1, 4]])


def test_saving_a_block_asks_for_the_operators_of_a_hook(model_and_module, arch):
    model, module = model_and_module
    block = layers(module, arch)[0]

    def hooks():
        out = []
        _with_hooks(module, [(block, lambda m, a, o: out.append(_first(o)))], IDS)
        return out[0]

    def trace():
        with model.trace(IDS):
            h = layers(model, arch)[0].output.save()
        return _first(h)

    (expected, want), (got, have) = _operators(hooks), _operators(trace)
    assert torch.equal(have, want)
    assert got == expected, _difference(expected, got)


def test_zeroing_every_mlp_asks_for_the_operators_of_hooks(model_and_module, arch):
    model, module = model_and_module
    mlps = [layer.mlp for layer in layers(module, arch)]

    def hooks():
        out = []
        edits = [(mlp, lambda m, a, o: torch.zeros_like(o)) for mlp in mlps]
        _with_hooks(module, edits + [(module.lm_head, lambda m, a, o: out.append(o))], IDS)
        return out[0]

    def trace():
        with model.trace(IDS):
            for layer in layers(model, arch):
                layer.mlp.output = torch.zeros_like(layer.mlp.output)
            logits = model.lm_head.output.save()
        return logits

    (expected, want), (got, have) = _operators(hooks), _operators(trace)
    assert torch.equal(have, want)
    assert got == expected, _difference(expected, got)


def _difference(expected, got):
    names = sorted(set(expected) | set(got))
    return "operators per call (hooks -> trace): " + ", ".join(
        f"{n} {expected[n]} -> {got[n]}" for n in names if expected[n] != got[n])
