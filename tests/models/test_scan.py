"""`model.scan` on a LanguageModel: prompts are tokenized and padded as `trace` does them, so
the shapes a scan reports are the real trace's (reference: the real trace)."""

import pytest
import torch

from conftest import layers


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def test_padded_invokes_scan_to_the_real_shapes(lm, arch):
    def body(trace):
        with trace() as tracer:
            with tracer.invoke("hello world"):
                a = _first(layers(lm, arch)[0].output).save()
            with tracer.invoke(["the quick brown fox jumps over", "the capital of"]):
                b = lm.lm_head.output.save()
        return a, b

    fake = body(lm.scan)
    real = body(lm.trace)
    for f, r in zip(fake, real):
        assert f.device.type == "meta" and f.shape == r.shape and f.dtype == r.dtype


def test_a_scan_checks_an_edit_across_prompts(lm, arch):
    with pytest.raises(RuntimeError):
        with lm.scan("hello world") as tracer:
            layers(lm, arch)[1].mlp.output[:, -1] = torch.zeros(3)
    with lm.scan("hello world") as tracer:  # the right shape passes
        layers(lm, arch)[1].mlp.output[:, -1] = torch.zeros(64)
        ids = tracer.result.save()
    assert ids.logits.device.type == "meta"
