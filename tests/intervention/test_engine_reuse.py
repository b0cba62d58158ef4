"""The engine reuses its interleaver across traces (a trace's fixed cost), and reuse changes
nothing a user can observe: the idle interleaver holds nothing of the run, and a trace after
a failed, stopped or nested-error trace gives what plain torch hooks give."""

import pytest
import torch

import interlace
from interlace import InterlaceError
from interlace.intervention.access import engine_of


def _plain_output(module, sub, x):
    """`sub`'s output in a plain forward of `module` (the reference: a torch hook)."""
    seen = []
    handle = sub.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    try:
        with torch.no_grad():
            module(x)
    finally:
        handle.remove()
    return seen[0]


def test_consecutive_traces_share_one_interleaver_that_keeps_nothing(mlp, x6):
    model = interlace.Model(mlp)
    engine = engine_of(model)
    seen = []
    for _ in range(3):
        with torch.no_grad(), model.trace(x6):
            seen.append(engine.active())
            h = model[2].output.save()
    assert seen[0] is seen[1] is seen[2]
    assert engine.idle == [seen[0]]
    idle = seen[0]
    assert idle.mediators == [] and idle.hub is None and idle.current is None
    assert idle.serving is None and idle.stopper is None and idle.failure is None
    assert not idle.handles and not idle.overrides and not idle.extensions and not idle.cleanups
    assert not idle.taps and not idle.tapped  # no module keeps a tap (hooks.py)
    assert all("forward" not in m.__dict__ for m in mlp.modules())
    assert idle.routed is None and idle.message is None  # no cycle through bound methods
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in mlp.modules())
    torch.testing.assert_close(h, _plain_output(mlp, mlp[2], x6), rtol=0, atol=0)


def test_a_trace_after_a_failed_or_stopped_one_is_exact(mlp, x6):
    model = interlace.Model(mlp)
    reference = _plain_output(mlp, mlp[4], x6)

    with pytest.raises(ZeroDivisionError):
        with torch.no_grad(), model.trace(x6):
            model[2].output[:] = 0
            1 / 0
    with torch.no_grad(), model.trace(x6) as tracer:
        a = model[0].output.save()
        tracer.stop()
    with pytest.raises(InterlaceError, match="already being traced"):
        with torch.no_grad(), model.trace(x6):
            with model.trace(x6):
                b = model[0].output.save()
    with torch.no_grad(), model.trace(x6):
        out = model[4].output.save()

    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    assert not torch.equal(out, torch.zeros_like(out))  # the earlier edit did not linger


def test_nested_traces_of_two_models_use_their_own_interleavers(mlp, x6):
    first = interlace.Model(mlp)
    second = interlace.Model(torch.nn.Sequential(torch.nn.Linear(6, 3)))
    with torch.no_grad(), first.trace(x6):
        h = first[0].output.save()
        with second.trace(x6):
            g = second[0].output.save()
    torch.testing.assert_close(h, _plain_output(mlp, mlp[0], x6), rtol=0, atol=0)
    inner = engine_of(second).module
    torch.testing.assert_close(g, _plain_output(inner, inner[0], x6), rtol=0, atol=0)
    assert engine_of(first).idle[0] is not engine_of(second).idle[0]
