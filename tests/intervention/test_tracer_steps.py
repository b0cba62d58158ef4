"""A Tracer subclass's steps change what every route runs: a trace with inputs, invokes, sweeps.

The subclasses here override `build` (the specified shape, `build(node) -> ast.Module`) to
append `h = save(h * 2)` to each body. The reference is plain torch hooks on the same model.
"""

import ast

import torch

from interlace import save  # noqa: F401 - read by the code the build step adds
from interlace.intervention.tracer import InterleavingTracer, Invoker
from interlace.sweeps import SweepTracer

from .helpers import reference_outputs


class Twice:
    """The `build` step: `h = save(h * 2)` after the body's own statements."""

    def build(self, node):
        module = super().build(node)
        extra = ast.parse("h = save(h * 2)").body[0]
        ast.increment_lineno(extra, node.end_lineno - 1)
        module.body.append(extra)
        return module


class TwiceTrace(Twice, InterleavingTracer):
    pass


class TwiceInvoker(Twice, Invoker):
    pass


class InvokesTwice(InterleavingTracer):
    def invoke(self, *args, **kwargs):
        super().invoke(*args, **kwargs)  # its checks
        return TwiceInvoker(self, args, kwargs)


class TwiceSweep(Twice, SweepTracer):
    pass


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 1000, (1, 8), generator=g) for _ in range(2)]


def _mlp_out(gpt2, prompt):
    (out,), _ = reference_outputs(gpt2, (prompt,), [gpt2.transformer.h[0].mlp])
    return out


def test_a_trace_with_inputs_runs_the_built_body(gpt2, gpt2_model):
    prompt = _prompts()[0]
    with torch.no_grad(), TwiceTrace(gpt2_model, (prompt,), {}):
        h = gpt2_model.transformer.h[0].mlp.output.save()
    assert torch.allclose(h, 2 * _mlp_out(gpt2, prompt), atol=1e-6)


def test_invokes_run_the_built_body(gpt2, gpt2_model):
    p1, p2 = _prompts()
    with torch.no_grad(), InvokesTwice(gpt2_model) as tracer:
        with tracer.invoke(p1):
            h = gpt2_model.transformer.h[0].mlp.output.save()
        with tracer.invoke(p2):
            h = gpt2_model.transformer.h[0].mlp.output.save()
            first = h  # before the appended statement doubles it
    assert torch.allclose(h, 2 * _mlp_out(gpt2, p2), atol=1e-6)
    assert torch.allclose(first, _mlp_out(gpt2, p2), atol=1e-6)


def test_each_sweep_item_runs_the_built_body(gpt2, gpt2_model):
    prompts = _prompts()
    with torch.no_grad(), TwiceSweep(gpt2_model, prompts, progress=False):
        h = gpt2_model.transformer.h[0].mlp.output.save()
    assert len(h) == 2
    for got, prompt in zip(h, prompts):
        assert torch.allclose(got, 2 * _mlp_out(gpt2, prompt), atol=1e-6)
