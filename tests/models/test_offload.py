"""accelerate device maps: a layer offloaded to disk traces like the model loaded whole.

CPU-only: the explicit map keeps everything on "cpu" except one decoder layer on "disk"
(its weights live in an offload folder and are loaded by accelerate's hooks per call).
"""

import pytest
import torch

from conftest import encode, layers

import interlace
from interlace import LanguageModel

PROMPT = "the capital of france is"


def offload_map(module, arch):
    base = module.base_model_prefix
    stack = "h" if arch == "gpt2" else "layers"
    device_map = {f"{base}.{name}": "cpu" for name, _ in getattr(module, base).named_children() if name != stack}
    device_map.update({f"{base}.{stack}.0": "cpu", f"{base}.{stack}.1": "disk", "lm_head": "cpu"})
    return device_map


@pytest.fixture(scope="module")
def offloaded(model_dir, hf_model, arch, tmp_path_factory):
    model = LanguageModel(model_dir, device_map=offload_map(hf_model, arch),
                          offload_folder=str(tmp_path_factory.mktemp("offload")))
    assert model._module.hf_device_map[f"{hf_model.base_model_prefix}.{'h' if arch == 'gpt2' else 'layers'}.1"] == "disk"
    # The offloaded layer's weights really are not in memory.
    assert {p.device.type for p in layers(model._module, arch)[1].parameters()} == {"meta"}
    return model


def test_reads_equal_the_whole_model(offloaded, lm, arch):
    results = []
    for model in (lm, offloaded):
        with torch.no_grad():
            with model.trace(["hello", PROMPT]) as tracer:
                h1_in = layers(model, arch)[1].input.save()
                h1 = layers(model, arch)[1].output.save()
                logits = tracer.result.logits.save()
        results.append((h1_in, h1, logits))
    for whole, off in zip(*results):
        torch.testing.assert_close(off, whole)


def test_edits_equal_the_whole_model(offloaded, lm, arch):
    outs = []
    for model in (lm, offloaded):
        with torch.no_grad():
            with model.trace(PROMPT) as tracer:
                layers(model, arch)[1].mlp.output[:] = 0  # inside the disk-offloaded layer
                logits = tracer.result.logits.save()
        outs.append(logits)
    torch.testing.assert_close(outs[1], outs[0])
    with torch.no_grad():
        plain = lm._module(encode(lm.tokenizer, PROMPT)).logits
    assert not torch.allclose(outs[1], plain, atol=1e-3)


def test_generation_with_iter_equals_the_whole_model(offloaded, lm, arch):
    outs = []
    for model in (lm, offloaded):
        with model.generate(PROMPT, max_new_tokens=5, do_sample=False) as tracer:
            seen = interlace.save([])
            for step in tracer.iter[:5]:
                if step == 2:
                    layers(model, arch)[0].mlp.output[:] = 0
                seen.append(layers(model, arch)[1].output)  # the disk-offloaded layer
            ids = tracer.result.save()
        outs.append((seen, ids))
    (seen_w, ids_w), (seen_o, ids_o) = outs
    assert torch.equal(ids_o, ids_w)
    assert len(seen_o) == len(seen_w) == 5
    for a, b in zip(seen_o, seen_w):
        torch.testing.assert_close(a, b)
    with lm.generate(PROMPT, max_new_tokens=5, do_sample=False) as tracer:
        plain = tracer.result.save()
    assert not torch.equal(ids_o, plain)


def test_model_left_clean(offloaded, arch):
    module = offloaded._module
    layer = layers(module, arch)[1]
    hooks = [m for m in module.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooks == []
    assert hasattr(layer, "_hf_hook")  # accelerate's own hook is still there, untouched
    with torch.no_grad():
        out = offloaded(encode(offloaded.tokenizer, PROMPT)).logits
    assert out.shape[-1] == module.config.vocab_size


def test_device_map_auto(model_dir, lm, arch):
    """On a CPU-only machine "auto" puts everything on the CPU: same values as loaded whole."""
    auto = LanguageModel(model_dir, device_map="auto")
    assert {p.device.type for p in auto._module.parameters()} == {"cpu"}
    outs = []
    for model in (lm, auto):
        with torch.no_grad():
            with model.trace(PROMPT):
                h = layers(model, arch)[0].output.save()
        outs.append(h)
    torch.testing.assert_close(outs[1], outs[0])


def test_skip_of_an_offloaded_layer_equals_the_whole_model(offloaded, lm, arch):
    outs = []
    for model in (lm, offloaded):
        with torch.no_grad():
            with model.trace(PROMPT) as tracer:
                layers(model, arch)[1].skip(layers(model, arch)[0].output)
                logits = tracer.result.logits.save()
        outs.append(logits)
    torch.testing.assert_close(outs[1], outs[0])
    layer = layers(offloaded._module, arch)[1]
    assert "forward" in layer.__dict__  # accelerate's own forward wrapper is back in place
    with torch.no_grad():
        plain = offloaded._module(encode(offloaded.tokenizer, PROMPT)).logits
        whole = lm._module(encode(lm.tokenizer, PROMPT)).logits
    torch.testing.assert_close(plain, whole)  # the offloaded layer runs again afterwards
    assert not torch.allclose(outs[1], plain, atol=1e-3)
