"""Invokes run again and again: each run equals the first one and plain hooks, whichever way
its bodies run (a site's first runs audit it on greenlets; invokes that share no variable
run as generators from then on, intervention/routes.py). References: plain torch hooks on
the same model, each invoke's rows run alone."""

import pytest
import torch

import interlace
from interlace.intervention import routes

from .helpers import assert_clean, hooked

IDS = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(31))
RUNS = 4


def _kind(model):
    """Inside a body: the class of the mediator running it."""
    return type(model._active().current).__name__


def _alone(gpt2, ids, output=None):
    """{module: output} of the blocks and the logits, by plain hooks, for `ids` alone."""
    seen = {}

    def grab(name):
        def hook(m, a, out):
            seen[name] = (out[0] if isinstance(out, tuple) else out).clone()
        return hook

    grabs = {gpt2.transformer.h[1]: grab("h1"), gpt2.lm_head: grab("logits")}
    with torch.no_grad(), hooked(gpt2, output=output or {}), hooked(gpt2, output=grabs):
        gpt2(ids)
    return seen


def _generators_from_the_third_run(kinds):
    if routes.ENABLED:
        assert kinds[-1] == "GeneratorMediator" and kinds[-2] == "GeneratorMediator", kinds
    else:
        assert set(kinds) == {"Mediator"}, kinds


def test_reads_inputs_and_edits_of_invokes_equal_each_row_alone_on_every_run(gpt2, gpt2_model):
    model = gpt2_model
    zero = {gpt2.transformer.h[0].mlp: lambda m, a, out: out * 0}
    want = [_alone(gpt2, IDS[:1]), _alone(gpt2, IDS[1:], output=zero)]
    with torch.no_grad():
        embedded = gpt2.transformer.wte(IDS[1:]) + gpt2.transformer.wpe(torch.arange(8))
    kinds = []
    for _ in range(RUNS):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(IDS[:1]):
                h1_a = model.transformer.h[1].output.save()
                logits_a = model.lm_head.output.save()
            with tracer.invoke(IDS[1:]):
                kind = interlace.save(_kind(model))
                block_in = model.transformer.h[0].input.save()
                model.transformer.h[0].mlp.output = model.transformer.h[0].mlp.output * 0
                h1_b = model.transformer.h[1].output.save()
                logits_b = model.lm_head.output.save()
        kinds.append(kind)
        torch.testing.assert_close(h1_a, want[0]["h1"])
        torch.testing.assert_close(logits_a, want[0]["logits"])
        torch.testing.assert_close(h1_b, want[1]["h1"])
        torch.testing.assert_close(logits_b, want[1]["logits"])
        torch.testing.assert_close(block_in, embedded)
    _generators_from_the_third_run(kinds)
    assert_clean(gpt2)


def test_invokes_caches_hold_their_own_rows_on_every_run(gpt2, gpt2_model):
    model = gpt2_model
    want = [_alone(gpt2, IDS[:1]), _alone(gpt2, IDS[1:])]
    kinds = []
    for _ in range(RUNS):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(IDS[:1]):
                first = tracer.cache(modules=[model.transformer.h[1]])
            with tracer.invoke(IDS[1:]):
                kind = interlace.save(_kind(model))
                second = tracer.cache(modules=[model.transformer.h[1]])
                logits = model.lm_head.output.save()
        kinds.append(kind)
        for cache, alone in zip((first, second), want):
            torch.testing.assert_close(cache.model.transformer.h[1].output, alone["h1"])
        torch.testing.assert_close(logits, want[1]["logits"])
    _generators_from_the_third_run(kinds)


def test_an_edited_wrappers_invokes_get_their_edit_on_every_run(gpt2, gpt2_model):
    with gpt2_model.edit() as edited:
        edited.transformer.h[0].mlp.output[:] = 0
    zero = {gpt2.transformer.h[0].mlp: lambda m, a, out: out * 0}
    want = [_alone(gpt2, IDS[i:i + 1], output=zero) for i in range(2)]
    kinds = []
    for _ in range(RUNS):
        with torch.no_grad(), edited.trace() as tracer:
            with tracer.invoke(IDS[:1]):
                a = edited.lm_head.output.save()
            with tracer.invoke(IDS[1:]):
                kind = interlace.save(_kind(edited))
                b = edited.lm_head.output.save()
        kinds.append(kind)
        torch.testing.assert_close(a, want[0]["logits"])
        torch.testing.assert_close(b, want[1]["logits"])
    _generators_from_the_third_run(kinds)


def test_an_error_in_an_invoke_is_the_same_on_every_run_and_names_its_line(gpt2_model):
    model = gpt2_model
    messages = []
    for _ in range(RUNS):
        with pytest.raises(IndexError) as info:
            with torch.no_grad(), model.trace() as tracer:
                with tracer.invoke(IDS[:1]):
                    model.lm_head.output.save()
                with tracer.invoke(IDS[1:]):
                    h = model.transformer.h[0].output[0]
                    h[:, 99] = 0  # column 99 of 64: an IndexError at this line
        frames = [(tb.tb_frame.f_code.co_filename, tb.tb_lineno) for tb in _walk(info.value.__traceback__)]
        assert (__file__, _line_of("h[:, 99] = 0")) in frames
        ours = [tb.tb_frame.f_code.co_name for tb in _walk(info.value.__traceback__)
                if "/interlace/" in tb.tb_frame.f_code.co_filename]
        # natively no interlace frame; the twin keeps the one `__exit__` that re-raises
        assert ours == ([] if interlace.native else ["__exit__"]), ours
        messages.append(str(info.value))
    assert len(set(messages)) == 1
    with torch.no_grad(), model.trace(IDS) as tracer:  # the model is usable after each error
        out = model.lm_head.output.save()
    assert out.shape[:2] == (2, 8)


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _line_of(text):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


def test_a_value_without_a_batch_dim_edited_by_one_invoke_stays_its_own_on_every_run(gpt2, gpt2_model):
    """The position embeddings (1, S, D) are every invoke's: the invoke that zeroes them in
    place gets its own copy, the other sees them as they are, on every run."""
    model = gpt2_model
    zeroed = {gpt2.transformer.wpe: lambda m, a, out: out * 0}
    want = [_alone(gpt2, IDS[:1], output=zeroed), _alone(gpt2, IDS[1:])]
    kinds = []
    for _ in range(RUNS):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(IDS[:1]):
                model.transformer.wpe.output[:] = 0
                a = model.lm_head.output.save()
            with tracer.invoke(IDS[1:]):
                kind = interlace.save(_kind(model))
                positions = model.transformer.wpe.output.save()
                b = model.lm_head.output.save()
        kinds.append(kind)
        assert positions.shape[0] == 1 and positions.abs().sum() > 0
        torch.testing.assert_close(a, want[0]["logits"])
        torch.testing.assert_close(b, want[1]["logits"])
    _generators_from_the_third_run(kinds)
