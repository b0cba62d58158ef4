"""`model.session()`: several traces in one block; later traces use earlier traces' values
without `.save()`; only saved values come back when the session ends.

Reference: plain torch forward hooks reading and patching the same activations.
"""

import gc
import weakref

import pytest
import torch

import interlace
from interlace.intervention.session import Session

from .helpers import assert_clean, hooked

IDS = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(21))
OTHER = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(22))


def layers(model, arch):
    return model.transformer.h if arch == "gpt2" else model.model.layers


@pytest.fixture(params=["gpt2", "llama"])
def arch(request):
    return request.param


@pytest.fixture
def module(arch, gpt2, llama):
    return gpt2 if arch == "gpt2" else llama


@pytest.fixture
def model(arch, gpt2_model, llama_model):
    return gpt2_model if arch == "gpt2" else llama_model


def block_output(module, arch, ids, layer=0):
    seen = []
    with torch.no_grad(), hooked(module, output={layers(module, arch)[layer]: lambda m, a, o: seen.append(o.clone())}):
        module(ids)
    return seen[0]


def patched(module, arch, ids, value, layer=0):
    def patch(m, a, out):
        out = out.clone()
        out[:, -1] = value
        return out

    with torch.no_grad(), hooked(module, output={layers(module, arch)[layer]: patch}):
        return module(ids).logits


def test_a_later_trace_patches_in_an_earlier_traces_activation_without_save(module, model, arch):
    with torch.no_grad(), model.session() as session:
        with model.trace(IDS):
            clean = layers(model, arch)[0].output[:, -1]  # not saved: the session keeps it
        with model.trace(OTHER):
            layers(model, arch)[0].output[:, -1] = clean
            logits = model.lm_head.output.save()
    assert isinstance(session, Session) and session.model is model
    ref = patched(module, arch, OTHER, block_output(module, arch, IDS)[:, -1])
    assert torch.equal(logits, ref)
    with torch.no_grad():
        assert not torch.equal(logits, module(OTHER).logits)
    assert_clean(module)


def test_only_saved_values_come_back_and_the_session_body_sees_every_value(module, model, arch):
    with torch.no_grad(), model.session():
        with model.trace(IDS):
            h = layers(model, arch)[0].output
            last = model.lm_head.output.save()
        norm = h.norm()  # ordinary Python between traces sees the first trace's values
        scale = 2.0
        with model.trace(IDS):
            layers(model, arch)[0].output[:] = h / norm * scale
            out = model.lm_head.output.save()
        both = [norm, scale].save()
    ref_h = block_output(module, arch, IDS)
    with torch.no_grad():
        assert torch.equal(last, module(IDS).logits)
        scaled = lambda m, a, o: ref_h / ref_h.norm() * 2.0  # noqa: E731
        with hooked(module, output={layers(module, arch)[0]: scaled}):
            ref = module(IDS).logits
    assert torch.equal(out, ref) and not torch.equal(out, last)
    assert torch.equal(both[0], ref_h.norm()) and both[1] == 2.0
    with pytest.raises(UnboundLocalError):  # not saved: not bound after the session
        h  # noqa: B018
    with pytest.raises(UnboundLocalError):
        norm  # noqa: B018
    with pytest.raises(UnboundLocalError):
        scale  # noqa: B018


def test_a_loop_of_traces_collects_into_a_saved_list(module, model, arch):
    n = len(layers(module, arch))
    with torch.no_grad(), model.session():
        norms = [].save()
        for layer in range(n):
            with model.trace(IDS):
                norms.append(layers(model, arch)[layer].output.norm())
    assert len(norms) == n
    for layer, value in enumerate(norms):
        assert torch.equal(value, block_output(module, arch, IDS, layer).norm())


def test_an_edit_and_invokes_in_a_session_use_an_earlier_traces_value(module, model, arch):
    with torch.no_grad(), model.session():
        with model.trace(IDS):
            clean = layers(model, arch)[0].output[:, -1]
        with model.edit() as edited:  # the edit's body uses a value of the session
            layers(edited, arch)[0].output[:, -1] = clean
        with edited.trace() as tracer:
            with tracer.invoke(OTHER):
                a = edited.lm_head.output.save()
            with tracer.invoke(IDS.flip(1)):
                b = edited.lm_head.output.save()
    value = block_output(module, arch, IDS)[:, -1]
    # two invokes are one batch of 2 rows: equal to float32 rounding, not bitwise
    torch.testing.assert_close(a, patched(module, arch, OTHER, value))
    torch.testing.assert_close(b, patched(module, arch, IDS.flip(1), value))
    with torch.no_grad():
        assert not torch.allclose(a, module(OTHER).logits, atol=1e-3)


def test_an_error_in_a_trace_of_the_session_propagates_and_leaves_the_model_clean(module, model, arch):
    with pytest.raises(ZeroDivisionError):
        with torch.no_grad(), model.session():
            with model.trace(IDS):
                h = layers(model, arch)[0].output
            with model.trace(OTHER):
                layers(model, arch)[0].output[:] = h
                1 / 0
    assert_clean(module)
    with torch.no_grad(), model.session():
        with model.trace(IDS):
            ok = model.lm_head.output.save()
    with torch.no_grad():
        assert torch.equal(ok, module(IDS).logits)


def test_remote_is_refused_clearly(model):
    with pytest.raises(interlace.InterlaceError, match=r"model.session\(remote=True\): remote execution"):
        model.session(remote=True)
    assert isinstance(model.session(remote=False), Session)
    assert type(model.session(tracer_cls=interlace.Tracer)) is interlace.Tracer


def _session_values(module):
    model = interlace.Model(module)
    with torch.no_grad(), model.session():
        with model.trace(IDS):
            h = model.transformer.h[0].output
        with model.trace(OTHER):
            model.transformer.h[0].output[:, -1] = h[:, -1]
            logits = model.lm_head.output.save()
        refs = [weakref.ref(h)].save()
    return weakref.ref(model), refs[0], logits


def test_unsaved_values_of_a_session_are_freed_when_it_ends(gpt2):
    _session_values(gpt2)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        wrapper, h, logits = _session_values(gpt2)
        # what stays alive of the runs: the saved logits only (no cycle holds `h` or the wrapper)
        assert wrapper() is None and h() is None
        assert logits.shape == (1, 10, 1000)
    finally:
        if enabled:
            gc.enable()
