"""`model.scan(x)`: the trace on fake tensors. References: the real trace and the plain model."""

import logging
import traceback
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor

import interlace

from .helpers import assert_clean
from .memcheck import assert_freed, watch

IDS = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(31))


@pytest.fixture(params=["gpt2", "llama"])
def arch(request, gpt2, llama, gpt2_model, llama_model):
    if request.param == "gpt2":
        return gpt2, gpt2_model, lambda m: m.transformer.h
    return llama, llama_model, lambda m: m.model.layers


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def test_saved_values_carry_the_real_shapes_and_dtypes(arch):
    module, model, layers_of = arch
    with torch.no_grad(), model.scan(IDS) as tracer:
        h = _first(layers_of(model)[0].output).save()
        mlp = layers_of(model)[1].mlp.output.save()
        shape = interlace.save(model.lm_head.output.shape)
        result = tracer.result.save()
    with torch.no_grad(), model.trace(IDS) as tracer:
        real_h = _first(layers_of(model)[0].output).save()
        real_mlp = layers_of(model)[1].mlp.output.save()
    for fake, real in ((h, real_h), (mlp, real_mlp)):
        assert type(fake) is torch.Tensor and fake.device.type == "meta"  # not a FakeTensor
        assert fake.shape == real.shape and fake.dtype == real.dtype
    assert shape == (2, 8, 1000)
    assert result.logits.device.type == "meta" and result.logits.shape == (2, 8, 1000)
    with pytest.raises((RuntimeError, NotImplementedError)):
        float(h.sum())  # no data: says so at once
    assert_clean(module)


def test_no_compute_and_no_weight_touched(gpt2, gpt2_model):
    """The body edits a weight in place: the real weight keeps its values. Every module sees
    fake tensors, and the model still traces for real afterwards, equal to the plain model."""
    weight = gpt2.transformer.h[0].mlp.c_fc.weight
    before = weight.detach().clone()
    seen = []
    handle = gpt2.transformer.h[1].register_forward_hook(lambda m, a, o: seen.append(type(_first(o))))
    try:
        with torch.no_grad(), gpt2_model.scan(IDS):
            gpt2_model.transformer.h[0].mlp.c_fc.weight.mul_(0)
            gpt2_model.transformer.h[0].mlp.c_fc.weight.data[:] = 1
            out = gpt2_model.lm_head.output.save()
    finally:
        handle.remove()
    assert seen == [FakeTensor] and out.shape == (2, 8, 1000)
    assert torch.equal(weight, before)
    with torch.no_grad(), gpt2_model.trace(IDS):
        logits = gpt2_model.lm_head.output.save()
    with torch.no_grad():
        assert torch.equal(logits, gpt2(IDS).logits)


@pytest.mark.parametrize("arch_name", ["gpt2", "llama"])
def test_a_model_on_the_meta_device_scans(arch_name):
    """No weights at all: the model is built on the meta device."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if arch_name == "gpt2":
        config = GPT2Config(vocab_size=50257, n_positions=128, n_embd=768, n_layer=12, n_head=12)
        build = GPT2LMHeadModel
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4)
        build = LlamaForCausalLM
    with torch.device("meta"):
        module = build(config).eval()
    model = interlace.Model(module)
    layers = model.transformer.h if arch_name == "gpt2" else model.model.layers
    ids = torch.randint(0, 1000, (3, 16))
    with torch.no_grad(), model.scan(ids):
        h = _first(layers[-1].output).save()
        logits = model.lm_head.output.save()
    assert h.shape == (3, 16, config.hidden_size if arch_name == "llama" else 768)
    assert logits.shape == (3, 16, config.vocab_size)


def test_a_shape_error_raises_at_the_users_line(gpt2_model, caplog):
    with pytest.raises(RuntimeError, match="must match the existing size") as info:
        with torch.no_grad(), gpt2_model.scan(IDS):
            gpt2_model.transformer.h[0].output[:] = torch.zeros(3, 3)  # the user's mistake
    frames = traceback.extract_tb(info.tb)
    mine = [f for f in frames if f.filename == __file__]
    assert mine and mine[-1].line.endswith("# the user's mistake")
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if hasattr(info.value, "add_note"):
        assert "raised while scanning" in notes and f"{__file__}:{mine[-1].lineno}" in notes
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    with torch.no_grad(), gpt2_model.trace(IDS):  # clean afterwards
        logits = gpt2_model.lm_head.output.save()
    assert logits.shape == (2, 8, 1000)


def test_an_edit_the_model_cannot_take_names_the_edit(gpt2_model):
    """A wrong-shaped assignment fails inside the model: the note names the body's line."""
    with pytest.raises(RuntimeError) as info:
        with torch.no_grad(), gpt2_model.scan(IDS):
            gpt2_model.transformer.h[0].mlp.output = torch.zeros(2, 8, 3)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if hasattr(info.value, "add_note"):
        assert "model.transformer.h.0.mlp.output" in notes and "test_scan.py" in notes


def test_code_that_needs_values_is_explained(gpt2_model):
    with pytest.raises(DataDependentOutputException) as info:
        with torch.no_grad(), gpt2_model.scan(IDS):
            if gpt2_model.transformer.h[0].output.sum() > 0:
                pass
    if hasattr(info.value, "add_note"):
        assert "needs a tensor's values" in "\n".join(info.value.__notes__)


def test_invokes_lists_and_caches_come_back_as_meta(gpt2_model):
    with torch.no_grad(), gpt2_model.scan() as tracer:
        with tracer.invoke(IDS[:1]):
            steps = [].save()
            for layer in gpt2_model.transformer.h:
                steps.append(layer.output)
        with tracer.invoke(IDS):
            cache = tracer.cache(modules=[gpt2_model.lm_head])
    assert [s.shape for s in steps] == [(1, 8, 64)] * 2
    assert all(type(s) is torch.Tensor and s.device.type == "meta" for s in steps)
    out = cache.model.lm_head.output
    assert type(out) is torch.Tensor and out.device.type == "meta" and out.shape == (2, 8, 1000)


def test_scan_in_a_thread_does_not_mute_other_threads_logs():
    from interlace.intervention import scan

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    scan._QUIET.add()
    try:
        assert scan._QUIET in logger.filters
        record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "x", (), None)
        assert not scan._QUIET.filter(record)
        record.thread = -1
        assert scan._QUIET.filter(record)
    finally:
        scan._QUIET.remove()
    assert scan._QUIET not in logger.filters


def test_a_scan_is_freed_by_refcounting():
    from transformers import GPT2Config, GPT2LMHeadModel

    def run():
        module = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2,
                                            n_head=4, bos_token_id=0, eos_token_id=0)).eval()
        model = interlace.Model(module)
        refs = {"module": weakref.ref(module), "wrapper": weakref.ref(model)}
        for _ in range(2):
            with model.scan(IDS):
                h = model.transformer.h[0].output.save()
            watch(refs, "saved", h)
        return refs

    assert_freed(run)
