"""Taps: a run fires a plain module's events from a wrapper set as its forward, not torch hooks.

A module with no hooks of its own is called on torch's fast path while a trace reads or edits
it (a torch hook would send each call down the slow path); a module that has hooks, or any
global hook, gets torch hooks as before, so that ours still run after the user's. Values are
compared with plain torch hooks; after the run nothing is left on the model.
"""

import inspect
import os
import traceback

import pytest
import torch

import interlace
from interlace import save
from interlace._native import hotpath

from .helpers import assert_clean, hooked

PACKAGE = os.path.dirname(os.path.abspath(interlace.__file__))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def test_plain_module_is_tapped_not_hooked_while_the_body_reads_it(x6):
    net = _mlp()
    model = interlace.Model(net)
    for _ in range(2):  # the first trace learns the order (it taps every module), then one run
        with model.trace(x6):
            h = save(model[0].output)
            during = save((_tapped(net[0]), dict(net[0]._forward_hooks),
                           dict(net[0]._forward_pre_hooks), _tapped(net[2])))
        assert during == (True, {}, {}, _ == 0)
    assert torch.equal(h, net[0](x6))
    assert_clean(net)


def test_container_output_asked_from_inside_it_is_served(gpt2_model, gpt2, ids):
    # the container (transformer) starts before the body asks for its output: its tap,
    # installed with the layer's request, fires the output event when it returns
    seen = {}

    def keep(name, pick):
        def hook(m, a, o):
            seen[name] = pick(o)  # (returns None: a plain observer)
        return hook

    with torch.no_grad(), hooked(gpt2, output={
        gpt2.transformer.h[0]: keep("h0", lambda o: o),
        gpt2.transformer: keep("t", lambda o: o.last_hidden_state.clone()),
    }):
        gpt2(ids)
    with torch.no_grad(), gpt2_model.trace(ids):
        h0 = save(gpt2_model.transformer.h[0].output)
        last = save(gpt2_model.transformer.output.last_hidden_state.clone())
    h0_ref = seen["h0"][0] if isinstance(seen["h0"], tuple) else seen["h0"]
    h0_got = h0[0] if isinstance(h0, tuple) else h0
    assert torch.equal(h0_got, h0_ref)
    assert torch.equal(last, seen["t"])
    assert_clean(gpt2)


def test_edit_through_a_tap_matches_a_plain_hook_edit(x6):
    net = _mlp()
    model = interlace.Model(net)
    with torch.no_grad(), hooked(net, output={net[1]: lambda m, a, o: o * 0 + 1}):
        expected = net(x6)
    with torch.no_grad(), model.trace(x6):
        model[1].output = torch.ones_like(model[1].output)
        out = save(model.output)
    assert torch.equal(out, expected)
    assert_clean(net)


def test_input_edit_through_a_tap_matches_a_plain_pre_hook(x6):
    net = _mlp()
    model = interlace.Model(net)

    def double(m, args, kwargs):
        return (args[0] * 2,), kwargs

    with torch.no_grad(), hooked(net, pre={net[2]: double}):
        expected = net(x6)
    with torch.no_grad(), model.trace(x6):
        model[2].input = model[2].input * 2
        out = save(model.output)
    assert torch.equal(out, expected)
    assert_clean(net)


def test_module_with_a_user_hook_keeps_torch_hooks_and_sees_the_users_edit(x6):
    net = _mlp()
    model = interlace.Model(net)
    handle = net[0].register_forward_hook(lambda m, a, o: o + 1)
    try:
        with torch.no_grad(), model.trace(x6):
            h = save(model[0].output)
            tapped = save(type(net[0].__dict__.get("forward")))
        assert tapped is not hotpath.Tap
        assert torch.equal(h, torch.nn.functional.linear(x6, net[0].weight, net[0].bias) + 1)
    finally:
        handle.remove()
    assert_clean(net)


def test_global_hook_keeps_torch_hooks_and_the_global_hook_runs_first(x6):
    net = _mlp()
    model = interlace.Model(net)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: o * 3 if m is net[0] else None)
    try:
        with torch.no_grad(), model.trace(x6):
            h = save(model[0].output)
            tapped = save(type(net[0].__dict__.get("forward")))
        assert tapped is not hotpath.Tap
        assert torch.equal(h, torch.nn.functional.linear(x6, net[0].weight, net[0].bias) * 3)
    finally:
        handle.remove()
    assert_clean(net)


def test_forward_looks_like_the_original_while_tapped(x6):
    # generation inspects `self.forward`'s signature; code reads `.__self__`/`.__name__`
    net = _mlp()
    model = interlace.Model(net)
    original = inspect.signature(net[0].forward)
    with model.trace(x6):
        save(model[0].input)  # net[0] is tapped from here on
        forward = net[0].forward
        facts = save((type(forward), inspect.signature(forward), forward.__self__ is net[0],
                      forward.__name__))
    assert facts == (hotpath.Tap, original, True, "forward")


def test_instance_forward_of_the_user_is_wrapped_and_restored(x6):
    net = _mlp()
    calls = []
    plain = net[0].forward

    def own(x):
        calls.append(1)
        return plain(x) * 2

    net[0].forward = own
    model = interlace.Model(net)
    with torch.no_grad(), model.trace(x6):
        h = save(model[0].output)
    assert calls == [1]
    assert torch.equal(h, plain(x6) * 2)
    assert net[0].__dict__["forward"] is own


def test_model_error_inside_a_tapped_module_shows_no_interlace_frame(x6):
    class Broken(torch.nn.Module):
        def forward(self, x):
            return x @ torch.ones(5, 5)  # wrong shape: the model's own error

    net = torch.nn.Sequential(torch.nn.Linear(6, 6), Broken())
    model = interlace.Model(net)
    with pytest.raises(RuntimeError) as info:
        with model.trace(x6):
            save(model[1].output)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.name == "forward" and f.filename == __file__ for f in frames)
    ours = [f.name for f in frames if f.filename.startswith(PACKAGE) or f.filename.endswith(".pyx")]
    assert ours == ([] if interlace.native else ["__exit__"])  # the twin keeps the frame that re-raises
    assert "forward" not in net[1].__dict__


def test_skip_of_a_tapped_module_still_fires_its_output(x6):
    net = _mlp()
    model = interlace.Model(net)
    with torch.no_grad(), model.trace(x6):
        before = save(model[1].input)  # taps net[1] first
        model[1].skip(torch.zeros(3, 16))
        out1 = save(model[1].output)
        out = save(model.output)
    assert torch.equal(out1, torch.zeros(3, 16))
    assert torch.equal(out, net[2](torch.zeros(3, 16)))
    assert before.shape == (3, 16)
    assert_clean(net)


class _PropertyForward(torch.nn.Module):
    """A module whose `forward` is a property: an instance `forward` would never be read."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(6, 6)

    @property
    def forward(self):
        return self.inner.forward


def test_forward_property_keeps_torch_hooks(x6):
    torch.manual_seed(0)
    net = torch.nn.Sequential(_PropertyForward(), torch.nn.ReLU())
    model = interlace.Model(net)
    for _ in range(2):  # the learning trace, then a run that hooks only what is asked
        with torch.no_grad(), model.trace(x6):
            h = save(model[0].output)
            hooked_now = save(len(net[0]._forward_hooks))
        assert hooked_now == 1
        assert torch.equal(h, net[0].inner(x6))
    assert_clean(net)


@pytest.mark.parametrize("change", ["own hook", "global hook", "forward replaced"])
def test_a_warm_trace_checks_every_module_again(x6, change):
    """The compiled tapper (`hotpath.Taps`) taps a module it tapped before without asking
    Python again; a hook or a new forward added between traces must still be seen."""
    net = _mlp()
    model = interlace.Model(net)
    for _ in range(3):  # learn the order, then warm traces through the compiled tapper
        with torch.no_grad(), model.trace(x6):
            save(model[0].output)
    plain = torch.nn.functional.linear(x6, net[0].weight, net[0].bias)
    if change == "own hook":
        handle = net[0].register_forward_hook(lambda m, a, o: o + 1)
        undo, expected = handle.remove, plain + 1
    elif change == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: o * 3 if m is net[0] else None)
        undo, expected = handle.remove, plain * 3
    else:
        original = net[0].forward
        net[0].forward = lambda x: original(x) - 2

        def undo():
            del net[0].forward

        expected = plain - 2
    try:
        with pytest.warns(interlace.ForwardReplacedWarning) if change == "forward replaced" \
                else _nothing(), torch.no_grad(), model.trace(x6):
            h = save(model[0].output)
            tapped = save(_tapped(net[0]))
        assert torch.equal(h, expected)
        assert not tapped or change == "forward replaced"
    finally:
        undo()
    assert_clean(net)
    with torch.no_grad(), model.trace(x6):  # and once it is gone, the Tap again
        h = save(model[0].output)
        tapped = save(_tapped(net[0]))
    assert tapped and torch.equal(h, plain)
    assert_clean(net)


def _tapped(module):
    """Has `module` a forward wrapper of a run (a Tap; an express run's wrapper, express.py)
    on its instance, rather than a torch hook?"""
    forward = module.__dict__.get("forward")
    return type(forward) in (hotpath.Tap, hotpath.ExpressTap)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


class _Scale(torch.nn.Module):
    def forward(self, x, *, scale):
        return x * scale


class _CallsWithKeywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Scale()

    def forward(self, x):
        return self.inner(x, scale=3.0) + 1


def test_a_tapped_module_called_with_keywords_gets_them_read_and_edited(x6):
    """A wrapper set as `forward` is called as torch calls forwards (`forward(*args, **kwargs)`;
    natively through vectorcall, with the caller's own argument vector): the keywords reach the
    module as given, an input event sees them as a dict, and an edit of them is what runs.
    Each site runs three times: its audit run on the general run, then express runs."""
    net = _CallsWithKeywords().eval()
    model = interlace.Model(net)
    for _ in range(3):
        with torch.no_grad(), model.trace(x6):
            out = save(model.inner.output)  # output only: the forward called with the vector
            result = save(model.output)
        assert torch.equal(out, x6 * 3) and torch.equal(result, x6 * 3 + 1)
    for _ in range(3):
        with torch.no_grad(), model.trace(x6):
            args, kwargs = model.inner.inputs
            seen = save((len(args), dict(kwargs)))
            model.inner.inputs = ((args[0],), {"scale": 5.0})
            out = save(model.inner.output)
        assert seen == (1, {"scale": 3.0}) and torch.equal(out, x6 * 5)
    assert_clean(net)


@pytest.mark.parametrize("make", ["tap", "express tap"])
def test_a_wrapper_outside_a_run_is_the_forward_however_called(make):
    """Called with no run to serve (a Tap with no event set, an ExpressTap whose run is
    gone), a wrapper returns what the forward it wraps returns for the same arguments:
    positional, keywords, unpacked from a tuple and a dict, many of each."""
    import functools
    import gc
    import weakref

    def forward(*args, **kwargs):
        return args, kwargs

    if make == "tap":
        wrapper = hotpath.Tap(hotpath.Exchange(torch.is_grad_enabled, torch.set_grad_enabled), forward)
    else:
        class Run:
            pass

        run = Run()
        wrapper = hotpath.ExpressTap(weakref.ref(run), 3, forward)
        del run
        gc.collect()
    many = tuple(range(12)), {f"k{i}": i for i in range(9)}
    assert wrapper() == ((), {})
    assert wrapper(1, 2, k=3) == ((1, 2), {"k": 3})
    assert wrapper(*many[0], **many[1]) == many
    assert functools.partial(wrapper, 1, k=2)(3, j=4) == ((1, 3), {"k": 2, "j": 4})
    assert wrapper.__wrapped__ is forward
