"""`model.trace(x, trace=False)` and `model.trace(..., tracer_cls=...)`, as nnsight 0.8.1
documents them: the first runs the model on the inputs with no block and returns its output
(only the wrapper's recorded edits apply), the second builds the given tracer class.
References: the plain module, and plain torch hooks for the edit."""

import pytest
import torch

import interlace
from interlace.intervention.tracer import InterleavingTracer

from .helpers import assert_clean, hooked


def test_trace_false_returns_the_models_output_without_a_block(gpt2, gpt2_model, ids):
    with torch.no_grad():
        out = gpt2_model.trace(ids, trace=False)
        expected = gpt2(ids)
    assert torch.equal(out.logits, expected.logits)
    assert_clean(gpt2)


def test_trace_false_needs_no_source(mlp, mlp_model, x6):
    """Nothing is captured: it works where no `with` source could be read (exec of a string)."""
    namespace = {"model": mlp_model, "x": x6}
    exec("out = model.trace(x, trace=False)", namespace)
    with torch.no_grad():
        assert torch.equal(namespace["out"], mlp(x6))


def test_trace_false_applies_the_recorded_edits(gpt2, gpt2_model, ids):
    with gpt2_model.edit() as edited:
        gpt2_model.transformer.h[0].mlp.output[:] = 0

    def zero(module, args, output):
        return torch.zeros_like(output)

    with torch.no_grad():
        out = edited.trace(ids, trace=False)
        with hooked(gpt2, output={gpt2.transformer.h[0].mlp: zero}):
            expected = gpt2(ids)
        plain = gpt2_model.trace(ids, trace=False)  # the unedited wrapper stays unedited
    assert torch.equal(out.logits, expected.logits)
    assert torch.equal(plain.logits, gpt2(ids).logits)
    assert_clean(gpt2)


def test_trace_false_without_inputs_says_to_pass_them(mlp_model):
    with pytest.raises(interlace.InterlaceError, match=r"trace\(x, trace=False\)"):
        mlp_model.trace(trace=False)


class _Counting(InterleavingTracer):
    """A custom tracer class (nnsight's extension point): counts the traces it ran."""

    runs = 0

    def push_result(self, values):
        type(self).runs += 1
        super().push_result(values)


def test_tracer_cls_builds_that_tracer(mlp, mlp_model, x6):
    tracer = mlp_model.trace(x6, tracer_cls=_Counting)
    assert type(tracer) is _Counting
    before = _Counting.runs
    with torch.no_grad(), mlp_model.trace(x6, tracer_cls=_Counting) as tracer:
        h = mlp_model[2].output.save()
    assert type(tracer) is _Counting and _Counting.runs == before + 1
    with torch.no_grad():
        assert torch.equal(h, mlp[:3](x6))
        assert torch.equal(tracer.result, mlp(x6))


def test_tracer_cls_must_be_an_interleaving_tracer(mlp_model, x6):
    with pytest.raises(TypeError, match="tracer_cls= takes a subclass of .*InterleavingTracer"):
        mlp_model.trace(x6, tracer_cls=interlace.Tracer)
