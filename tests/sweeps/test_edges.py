"""Sharp edges of `model.sweep` (issue 16, item 6): zero items, `to_pandas` name clashes,
`sweep.stop()` / `sweep.cache()` / `sweep.barrier()`, and forwards of several arguments.

References: one trace per item running the same body (`tracer.stop()`, `tracer.cache()`
there), and the plain module called per item.
"""

import pytest
import torch

import interlace
from interlace.errors import InterlaceError

from .conftest import assert_clean


# -- zero items ----------------------------------------------------------------------------


def test_a_sweep_over_zero_items_binds_every_saved_name_to_an_empty_list(model, corrupt):
    with torch.no_grad(), model.sweep([], input=corrupt, progress=False) as sweep:
        h = model.transformer.h[0].output.save()
        logits = model.lm_head.output
        logits.save()
        top = interlace.save(logits[:, -1].argmax(-1))
        kept = (norm := h.norm().save())
        scratch = logits[:, -1]  # assigned, never saved: unbound, as after a trace
    assert h == [] and logits == [] and top == [] and kept == [] and norm == []
    assert list(sweep.results) == ["h", "logits", "top", "kept", "norm"]
    assert sweep.results.finished == []
    with pytest.raises(UnboundLocalError):
        scratch  # noqa: B018


def test_a_name_saved_only_on_a_path_no_item_took_is_a_list_of_none(model, corrupt):
    with torch.no_grad(), model.sweep(range(3), input=corrupt, progress=False) as sweep:
        if sweep.item > 10:
            rare = model.transformer.h[0].output.save()
        common = model.lm_head.output[:, -1].save()
    assert rare == [None, None, None]
    assert len(common) == 3


# -- to_pandas: a saved name equal to an item field ---------------------------------------


def test_to_pandas_keeps_an_item_field_and_a_saved_name_of_the_same_name(model, corrupt):
    pandas = pytest.importorskip("pandas", reason="to_pandas() needs pandas")
    items = [{"layer": layer, "score": 100 + layer} for layer in range(2)]
    with torch.no_grad(), model.sweep(items, input=corrupt, progress=False) as sweep:
        score = model.transformer.h[sweep.item["layer"]].output[0, -1, 0].save()
    frame = sweep.results.to_pandas()
    assert list(frame.columns) == ["layer", "score", "score_saved"]
    assert list(frame["score"]) == [100, 101]  # the item's field, not overwritten
    for layer in range(2):  # the saved value, as one trace of the item alone saves it
        with torch.no_grad(), model.trace(corrupt):
            alone = model.transformer.h[layer].output[0, -1, 0].save()
        assert frame["score_saved"][layer] == alone.item() == score[layer].item()
    assert isinstance(frame, pandas.DataFrame)


def test_to_pandas_raises_when_the_suffixed_name_is_taken_too(model, corrupt):
    pytest.importorskip("pandas", reason="to_pandas() needs pandas")
    items = [{"x": 1, "x_saved": 2}]
    with torch.no_grad(), model.sweep(items, input=corrupt, progress=False) as sweep:
        x = model.lm_head.output[0, -1, 0].save()
    with pytest.raises(InterlaceError, match="'x' is also an item field"):
        sweep.results.to_pandas()
    assert len(x) == 1


# -- sweep.stop() and sweep.cache(): per item, as in a trace of the item alone ----------------


def _prompts():
    return torch.randint(0, 1000, (6, 8), generator=torch.Generator().manual_seed(3))


def _alone(model, prompt, stop):
    """The same body in one trace of the item alone: (cache, h, logits or None)."""
    logits = None
    with torch.no_grad(), model.trace(prompt) as tracer:
        cache = tracer.cache()
        h = model.transformer.h[0].output.save()
        if stop:
            tracer.stop()
        logits = model.lm_head.output.save()
    return cache, h, logits


@pytest.mark.parametrize("batch_size", [1, 6])
def test_sweep_stop_ends_only_its_items_run_as_tracer_stop_in_a_trace_alone(
        gpt2, model, batch_size):
    prompts = _prompts()
    after = []
    with torch.no_grad(), model.sweep(range(6), input=lambda i: prompts[i:i + 1],
                                      batch_size=batch_size, progress=False) as sweep:
        cache = sweep.cache()
        h = model.transformer.h[0].output.save()
        if sweep.item % 3 == 1:
            sweep.stop()
            after.append(sweep.item)  # never runs
        logits = model.lm_head.output.save()
    assert after == []
    assert_clean(gpt2)
    assert len(cache) == len(h) == len(logits) == 6
    for i in range(6):
        stopped = i % 3 == 1
        alone_cache, alone_h, alone_logits = _alone(model, prompts[i:i + 1], stopped)
        torch.testing.assert_close(h[i], alone_h)
        if stopped:
            assert logits[i] is None and alone_logits is None
        else:
            torch.testing.assert_close(logits[i], alone_logits)
        # the same modules recorded (a stopped item's cache ends where the stop was), same values
        assert list(cache[i]) == list(alone_cache)
        for path in alone_cache:
            if path in ("model", "model.transformer"):  # (outputs holding the KV cache object)
                continue
            torch.testing.assert_close(cache[i][path].output, alone_cache[path].output)
    assert "model.lm_head" not in cache[1] and "model.lm_head" in cache[0]


def test_sweep_cache_with_modules_records_the_items_own_rows(model):
    prompts = _prompts()
    with torch.no_grad(), model.sweep(range(4), input=lambda i: prompts[i:i + 2],
                                      batch_size=4, progress=False) as sweep:
        cache = sweep.cache(modules=[model.transformer.h[1]], include_inputs=True)
    for i in range(4):
        with torch.no_grad(), model.trace(prompts[i:i + 2]) as tracer:
            alone = tracer.cache(modules=[model.transformer.h[1]], include_inputs=True)
        assert list(cache[i]) == list(alone) == ["model.transformer.h.1"]
        view, ref = cache[i]["model.transformer.h.1"], alone["model.transformer.h.1"]
        hidden = view.output[0] if isinstance(view.output, tuple) else view.output
        assert hidden.shape == (2, 8, 64)  # the item's two rows of the batch's eight
        torch.testing.assert_close(view.output, ref.output)
        torch.testing.assert_close(view.input, ref.input)


def test_sweep_stop_and_cache_outside_the_body_say_where_they_work(model, corrupt):
    with torch.no_grad(), model.sweep(range(1), input=corrupt, progress=False) as sweep:
        model.lm_head.output.save()
    with pytest.raises(InterlaceError, match="only available inside the body"):
        sweep.stop()
    with pytest.raises(InterlaceError, match="only available inside the body"):
        sweep.cache()


@pytest.mark.parametrize("call, use", [
    (lambda sweep: sweep.barrier(2), "tracer.barrier"),
    (lambda sweep: sweep.invoke(torch.zeros(1, 8, dtype=torch.long)), "interlace.Inputs"),
])
def test_sweep_barrier_and_invoke_say_what_to_use_instead(gpt2, model, corrupt, call, use):
    with pytest.raises(InterlaceError, match=use) as info:
        with torch.no_grad(), model.sweep(range(3), input=corrupt, progress=False) as sweep:
            x = model.lm_head.output[:, -1].save()
            call(sweep)
    assert f"raised by sweep item 0 (0) at {__file__}:" in info.value.__notes__[0]
    assert sweep.results.finished == [] and "x" in sweep.results
    assert_clean(gpt2)


# -- several positional arguments: interlace.Inputs -----------------------------------------


class TwoArgs(torch.nn.Module):
    """A forward of two positional arguments and a keyword."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 8)
        self.gate = torch.nn.Linear(3, 8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x, y, scale=1.0):
        return self.out(torch.tanh(self.proj(x)) * torch.sigmoid(self.gate(y)) * scale)


@pytest.fixture(scope="module")
def two():
    module = TwoArgs().eval()
    return module, interlace.Model(module)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_inputs_gives_each_item_several_positional_arguments(two, batch_size):
    module, model = two
    gen = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    with torch.no_grad(), model.sweep(
            range(8), input=lambda i: interlace.Inputs(xs[i:i + 1], ys[i:i + 1], scale=2.0),
            batch_size=batch_size, progress=False) as sweep:
        gate = model.gate.output.save()
        out = sweep.output.save()
    for i in range(8):
        with torch.no_grad():
            plain = module(xs[i:i + 1], ys[i:i + 1], scale=2.0)
            plain_gate = module.gate(ys[i:i + 1])
        torch.testing.assert_close(out[i], plain)
        torch.testing.assert_close(gate[i], plain_gate)
        with torch.no_grad(), model.trace(xs[i:i + 1], ys[i:i + 1], scale=2.0) as tracer:
            alone = tracer.result.save()
        torch.testing.assert_close(out[i], alone)
    assert_clean(module)


def test_a_shared_inputs_and_sweep_keywords_combine(two):
    module, model = two
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 6, generator=gen), torch.randn(2, 3, generator=gen)
    with torch.no_grad(), model.sweep([0.5, 1.0, 2.0], input=interlace.Inputs(x, y),
                                      scale=3.0, progress=False) as sweep:
        model.proj.output[:] *= sweep.item
        out = sweep.output.save()
    for factor, value in zip([0.5, 1.0, 2.0], out):
        handle = module.proj.register_forward_hook(lambda m, a, o, f=factor: o * f)
        try:
            with torch.no_grad():
                plain = module(x, y, scale=3.0)
        finally:
            handle.remove()
        torch.testing.assert_close(value, plain)


def test_inputs_repeating_a_sweep_keyword_is_an_error_naming_it(two):
    _, model = two
    x, y = torch.zeros(1, 6), torch.zeros(1, 3)
    with pytest.raises(TypeError, match="scale") as info:
        with torch.no_grad(), model.sweep(range(2), input=lambda i: interlace.Inputs(x, y, scale=i),
                                          scale=1.0, progress=False):
            model.out.output.save()
    assert "raised by sweep item 0" in info.value.__notes__[0]


def test_a_plain_tuple_input_stays_one_argument(mlp_model):
    pair = (torch.zeros(1, 6), torch.zeros(1, 6))
    with pytest.raises(Exception) as info:  # the Sequential gets the tuple itself
        with torch.no_grad(), mlp_model.sweep(range(1), input=pair, progress=False):
            mlp_model.output.save()
    assert "tuple" in str(info.value)
    assert repr(interlace.Inputs(1, k=2)) == "Inputs(1, k=2)"


def test_when_every_item_of_a_batch_stops_the_forward_pass_stops(gpt2, model):
    prompts = _prompts()
    ran = []
    handle = gpt2.lm_head.register_forward_hook(lambda m, a, o: ran.append(o.shape[0]))
    try:
        with torch.no_grad(), model.sweep(range(6), input=lambda i: prompts[i:i + 1],
                                          batch_size=3, progress=False) as sweep:
            h = model.transformer.h[0].output.save()
            if sweep.item >= 3:  # the second batch stops whole, the first runs on for 0-2
                sweep.stop()
            logits = model.lm_head.output.save()
    finally:
        handle.remove()
    assert ran == [3]  # as a trace alone: a stopped item's forward does not reach lm_head
    assert [x is None for x in logits] == [False] * 3 + [True] * 3
    for i in range(6):
        torch.testing.assert_close(h[i], _alone(model, prompts[i:i + 1], i >= 3)[1])
    assert_clean(gpt2)
