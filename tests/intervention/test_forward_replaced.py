"""Replacing a module's `forward` after wrapping warns once per module (nnsight 0.8.1 warns
too: there the replacement disables the module's interventions; here traces run the new
forward, but the learned module order came from the old one). Never for interlace's own taps
and overrides, nor for accelerate's hooks. Reference: the plain module with the same forward."""

import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401 - before any trace: accelerate's first call imports it, and
# its import reads every name dir() lists on its classes, `.save` too once a body mounted it
from accelerate.hooks import AlignDevicesHook, add_hook_to_module

import interlace


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 2)).eval()


def test_a_forward_replaced_after_wrapping_warns_once_per_module(x6):
    net = _net()
    model = interlace.Model(net)
    with torch.no_grad(), model.trace(x6):
        model[2].output.save()
    plain = net[2].forward
    net[2].forward = lambda h: plain(h) * 2
    with pytest.warns(interlace.ForwardReplacedWarning, match=r"model\.2: `forward` was replaced") as seen:
        with torch.no_grad(), model.trace(x6):
            h = model[2].output.save()  # the line the warning names
            out = model.output.save()
    assert len(seen) == 1 and seen[0].filename == __file__
    with torch.no_grad():
        assert torch.equal(h, net[:3](x6)) and torch.equal(out, net(x6))  # the new forward ran
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), model.trace(x6):  # once per module
            model[2].output.save()
    net[4].forward = net[4].forward
    with pytest.warns(interlace.ForwardReplacedWarning, match=r"model\.4"):
        with torch.no_grad(), model.trace(x6):
            model[4].output.save()


def test_a_forward_set_before_wrapping_or_put_back_does_not_warn(x6):
    net = _net()
    plain = net[0].forward
    net[0].forward = lambda x: plain(x) + 1
    model = interlace.Model(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), model.trace(x6):
            model[0].output.save()
        own = net[0].forward
        net[0].forward = lambda x: own(x) * 3
        net[0].forward = own  # put back
        with torch.no_grad(), model.trace(x6):
            h = model[0].output.save()
    with torch.no_grad():
        assert torch.equal(h, plain(x6) + 1)


def test_interlaces_own_taps_do_not_warn(x6):
    """Two wrappers of one module, one traced inside the other's body: the inner run (its
    first: it hooks every module) finds the outer run's tap on a module and does not take it
    for a replacement; a skip's forward override is not one either."""
    net = _net()
    outer, inner = interlace.Model(net), interlace.Model(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), outer.trace(x6):
            a = outer[0].output.save()
            with inner.trace(x6):
                b = inner[2].output.save()
        with torch.no_grad(), inner.trace(x6):
            inner[1].skip(inner[0].output)
            d = inner.output.save()
    with torch.no_grad():
        assert torch.equal(a, net[0](x6)) and torch.equal(b, net[:3](x6))
        assert torch.equal(d, net[2:](net[0](x6)))


def test_accelerates_hooks_added_after_wrapping_do_not_warn(x6):
    net = _net()
    model = interlace.Model(net)
    with torch.no_grad(), model.trace(x6):
        model[2].output.save()
    add_hook_to_module(net[2], AlignDevicesHook(execution_device="cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), model.trace(x6):
            h = model[2].output.save()
    with torch.no_grad():
        assert torch.equal(h, net[:3](x6))
