"""The mediator greenlet pool: workers it does not keep are freed, never left suspended."""

import gc

import greenlet
import pytest
import torch

import interlace
from interlace._native import hotpath
from interlace.intervention import mediator
from interlace.intervention.mediator import UNWIND_STOP


def _suspended_outside_the_pool():
    gc.collect()
    return [g for g in gc.get_objects()
            if issubclass(type(g), greenlet.greenlet) and g and g not in mediator.WORKERS.idle
            and g is not greenlet.getcurrent()]


def test_more_invokes_than_the_pool_keeps_leave_no_worker_behind(mlp, mlp_model):
    before = len(_suspended_outside_the_pool())
    n = hotpath.POOL_MAX + 4
    xs = [torch.randn(1, 6, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    for _ in range(2):
        with torch.no_grad(), mlp_model.trace() as tracer:
            outs = [].save()
            for x in xs:
                with tracer.invoke(x):
                    outs.append(mlp_model.output)
        with torch.no_grad():
            assert all(torch.allclose(o, mlp(x), atol=1e-6) for o, x in zip(outs, xs))
    assert len(mediator.WORKERS.idle) == hotpath.POOL_MAX
    assert len(_suspended_outside_the_pool()) == before


def test_dropping_the_pool_frees_its_workers(mlp_model, x6):
    with torch.no_grad(), mlp_model.trace(x6):
        out = mlp_model.output.save()  # noqa: F841
    assert mediator.WORKERS.idle
    mediator.WORKERS.idle.clear()
    assert _suspended_outside_the_pool() == []


def _workers_of_a_nested_then_a_top_level_trace(model, x, ref):
    """The greenlets that ran a trace nested in a Tracer's body, then a top-level trace."""
    mediator.WORKERS.idle.clear()
    ran_on = []
    with torch.no_grad(), interlace.Tracer():
        with model.trace(x):
            ran_on.append(greenlet.getcurrent())
            first = model.output.save()
    pooled = list(mediator.WORKERS.idle)
    with torch.no_grad(), model.trace(x):
        ran_on.append(greenlet.getcurrent())
        second = model.output.save()
    with torch.no_grad():
        assert torch.allclose(first, ref(x), atol=1e-6) and torch.allclose(second, ref(x), atol=1e-6)
    return ran_on, pooled


@pytest.mark.native_only
@pytest.mark.skipif(not UNWIND_STOP, reason="no unwind-terminating trampoline on this target")
def test_a_worker_made_inside_a_trace_body_is_reused_natively(mlp, mlp_model, x6):
    (nested, top), pooled = _workers_of_a_nested_then_a_top_level_trace(mlp_model, x6, mlp)
    assert pooled == [nested] and top is nested
    assert mediator.WORKERS.idle == [nested]


@pytest.mark.skipif(UNWIND_STOP, reason="workers start in the unwind-terminating trampoline")
def test_a_worker_made_inside_a_trace_body_is_not_reused_on_the_twin(mlp, mlp_model, x6):
    (nested, top), pooled = _workers_of_a_nested_then_a_top_level_trace(mlp_model, x6, mlp)
    assert pooled == [] and top is not nested
    assert mediator.WORKERS.idle == [top]


_NESTED_THEN_RAISE = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import interlace
from interlace.intervention import mediator

torch.manual_seed(0)
config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                    bos_token_id=0, eos_token_id=0)
model = interlace.Model(GPT2LMHeadModel(config).eval())
ids = torch.randint(0, 1000, (1, 16))
blocks = model.transformer.h


def nested(depth):
    if depth:  # through C frames (map): the nested trace starts deeper in the C stack
        return list(map(nested, [depth - 1]))
    with interlace.Tracer():
        with model.trace(ids):
            if ids is None:
                raise ValueError


raised = reused = 0
for depth in range(8):
    mediator.WORKERS.idle.clear()
    nested(depth)
    (worker,) = mediator.WORKERS.idle  # made inside the Tracer's body, and pooled
    for i in range(25):
        try:
            with model.trace(ids):
                if i % 4 == 0:
                    value = blocks[0].attn.c_attn.output
                elif i % 4 == 1:
                    value = blocks[0].mlp.output
                elif i % 4 == 2:
                    value = blocks[1].output[0]
                else:
                    value = model.lm_head.output
                torch.mm(value[0], torch.ones(3, 3))  # c10::Error: shapes cannot be multiplied
        except RuntimeError:
            raised += 1
        reused += mediator.WORKERS.idle == [worker]
print(raised, reused)
"""


@pytest.mark.slow  # starts a subprocess
@pytest.mark.native_only
@pytest.mark.skipif(not UNWIND_STOP, reason="no unwind-terminating trampoline on this target")
def test_torch_errors_on_a_reused_worker_made_inside_a_trace_body_do_not_crash(tmp_path):
    """Workers made in traces nested in a Tracer's body (at several C stack depths), reused by
    top-level traces whose bodies raise a torch error after reads at several depths: 200
    errors. With the greenlet's plain run function every such run of this script segfaulted
    (c10::Error's backtrace unwound into dead stack above the worker's first frame)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "nested_then_raise.py"
    script.write_text(_NESTED_THEN_RAISE)
    # this checkout's interlace; every body on a greenlet worker (the workers are the subject)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env["INTERLACE_GENERATORS"] = "0"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["200", "200"]


def test_call_below_calls_fn_once_and_passes_its_result_and_errors_on():
    """`hotpath.call_below` (new workers start below a forward that resumes them, natively):
    fn's result and errors pass through, and a depth the thread's stack has no room for is
    a plain call, not a crash."""
    from interlace._native import hotpath

    calls = []
    for depth in (0, 4096, mediator._BELOW, 1 << 40):
        assert hotpath.call_below(depth, lambda: calls.append(depth) or depth) == depth
    assert calls == [0, 4096, mediator._BELOW, 1 << 40]
    with pytest.raises(KeyError, match="inside"):
        hotpath.call_below(mediator._BELOW, lambda: {}["inside"])


def test_a_worker_started_below_runs_bodies_of_threads_with_small_stacks(mlp, mlp_model, x6):
    """A thread whose stack has no room below (threading.stack_size) still makes workers."""
    import threading

    out = []

    def trace():
        mediator.WORKERS.idle.clear()
        with torch.no_grad(), mlp_model.trace(x6):
            value = mlp_model.output.save()
        out.append(value)

    old = threading.stack_size(256 * 1024)  # less than twice the depth a worker starts below
    try:
        thread = threading.Thread(target=trace)
        thread.start()
        thread.join()
    finally:
        threading.stack_size(old)
    with torch.no_grad():
        assert len(out) == 1 and torch.allclose(out[0], mlp(x6), atol=1e-6)
