"""The mediator greenlet pool: workers it does not keep are freed, never left suspended."""

import gc

import greenlet
import torch

import interlace
from interlace.intervention import mediator


def _suspended_outside_the_pool():
    gc.collect()
    return [g for g in gc.get_objects()
            if issubclass(type(g), greenlet.greenlet) and g and g not in mediator._pool.idle
            and g is not greenlet.getcurrent()]


def test_more_invokes_than_the_pool_keeps_leave_no_worker_behind(mlp, mlp_model):
    before = len(_suspended_outside_the_pool())
    n = mediator._POOL_MAX + 4
    xs = [torch.randn(1, 6, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    for _ in range(2):
        with torch.no_grad(), mlp_model.trace() as tracer:
            outs = [].save()
            for x in xs:
                with tracer.invoke(x):
                    outs.append(mlp_model.output)
        with torch.no_grad():
            assert all(torch.allclose(o, mlp(x), atol=1e-6) for o, x in zip(outs, xs))
    assert len(mediator._pool.idle) == mediator._POOL_MAX
    assert len(_suspended_outside_the_pool()) == before


def test_dropping_the_pool_frees_its_workers(mlp_model, x6):
    with torch.no_grad(), mlp_model.trace(x6):
        out = mlp_model.output.save()  # noqa: F841
    assert mediator._pool.idle
    mediator._pool.idle.clear()
    assert _suspended_outside_the_pool() == []
