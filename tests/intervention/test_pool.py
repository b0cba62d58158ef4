"""The mediator greenlet pool: workers it does not keep are freed, never left suspended."""

import gc

import greenlet
import pytest
import torch

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


@pytest.mark.slow  # starts a subprocess
def test_a_worker_made_inside_a_trace_body_is_not_reused(tmp_path):
    """A trace nested in a Tracer's body, then a trace where torch raises after a hook: the
    nested trace's worker was pooled and reusing it crashed the process (natively)."""
    import subprocess
    import sys

    script = tmp_path / "nested_then_raise.py"
    script.write_text(
        "import torch, interlace\n"
        "model = interlace.Model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))\n"
        "x = torch.randn(2, 4)\n"
        "def first():\n"
        "    with interlace.Tracer():\n"
        "        with model.trace(x):\n"
        "            if x is None:\n"
        "                raise ValueError\n"
        "def second():\n"
        "    try:\n"
        "        with model.trace(x):\n"
        "            model[0].output[:] = torch.ones(3)\n"
        "    except RuntimeError:\n"
        "        print('raised')\n"
        "first(); second(); second(); print('done')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["raised", "raised", "done"]
