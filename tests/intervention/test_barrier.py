"""`tracer.barrier(n)`: invokes meet mid-forward and exchange values; a barrier that can never
fill is a clear error, never a hang. References: plain hooks on the plain model."""

import weakref

import pytest
import torch

import interlace
from interlace import InterlaceError
from interlace.intervention.barrier import BarrierError

from .helpers import assert_clean, hooked
from .memcheck import assert_freed

CLEAN = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(21))
CORRUPT = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(22))


@pytest.fixture(params=["gpt2", "llama"])
def arch(request, gpt2, llama, gpt2_model, llama_model):
    if request.param == "gpt2":
        return gpt2, gpt2_model, lambda m: m.transformer.h
    return llama, llama_model, lambda m: m.model.layers


def _out(value):
    return value[0] if isinstance(value, tuple) else value


def patched_reference(module, layer, position=-1):
    """Plain hooks: layer's output at `position` from the clean run, patched into the corrupt run."""
    seen = {}

    def grab(m, a, out):
        seen["h"] = _out(out)[:, position].clone()

    def patch(m, a, out):
        _out(out)[:, position] = seen["h"]

    with torch.no_grad():
        with hooked(module, output={layer: grab}):
            module(CLEAN)
        with hooked(module, output={layer: patch}):
            patched = module(CORRUPT).logits
        plain = module(CORRUPT).logits
    return patched, plain


def test_patch_invoke_2_with_invoke_1_at_the_same_layer(arch):
    module, model, layers_of = arch
    with torch.no_grad(), model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CLEAN):
            h = _out(layers_of(model)[1].output)[:, -1]
            barrier()
        with tracer.invoke(CORRUPT):
            barrier()
            _out(layers_of(model)[1].output)[:, -1] = h
            logits = model.lm_head.output.save()
    patched, plain = patched_reference(module, layers_of(module)[1])
    torch.testing.assert_close(logits, patched, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-4)  # the patch changed the result
    assert_clean(module)


def test_a_later_invoke_hands_a_value_to_an_earlier_one(gpt2, gpt2_model):
    """Through a shared dict (not a variable, which invokes already wait for): invoke 0 waits
    at the barrier until invoke 1 has put its layer-0 output there, then patches layer 1."""
    box = {}
    with torch.no_grad(), gpt2_model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CLEAN):
            barrier()
            gpt2_model.transformer.h[1].output[:, 0] = box["h"]
            logits = gpt2_model.lm_head.output.save()
        with tracer.invoke(CORRUPT):
            box["h"] = gpt2_model.transformer.h[0].output[:, 0].clone()
            barrier()
    seen = {}

    def grab(m, a, out):
        seen["h"] = out[:, 0].clone()

    def patch(m, a, out):
        out[:, 0] = seen["h"]

    with torch.no_grad():
        with hooked(gpt2, output={gpt2.transformer.h[0]: grab}):
            gpt2(CORRUPT)
        with hooked(gpt2, output={gpt2.transformer.h[1]: patch}):
            want = gpt2(CLEAN).logits
        plain = gpt2(CLEAN).logits
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-4)


def test_one_barrier_many_rounds_every_layer(gpt2, gpt2_model):
    """A barrier is reusable: each round waits for its own n arrivals (one round per layer)."""
    with torch.no_grad(), gpt2_model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CLEAN):
            for layer in gpt2_model.transformer.h:
                h = layer.output[:, -1].clone()
                barrier()
        with tracer.invoke(CORRUPT):
            for layer in gpt2_model.transformer.h:
                barrier()
                layer.output[:, -1] = h
            logits = gpt2_model.lm_head.output.save()
    seen = {}

    def grab(i):
        def hook(m, a, out):
            seen[i] = out[:, -1].clone()

        return hook

    def patch(i):
        def hook(m, a, out):
            out[:, -1] = seen[i]

        return hook

    blocks = list(gpt2.transformer.h)
    with torch.no_grad():
        with hooked(gpt2, output={b: grab(i) for i, b in enumerate(blocks)}):
            gpt2(CLEAN)
        with hooked(gpt2, output={b: patch(i) for i, b in enumerate(blocks)}):
            want = gpt2(CORRUPT).logits
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_barrier_of_one_passes_at_once(mlp, mlp_model, x6):
    with torch.no_grad(), mlp_model.trace(x6) as tracer:
        barrier = tracer.barrier(1)
        barrier()
        out = mlp_model.output.save()
    with torch.no_grad():
        assert torch.equal(out, mlp(x6))


def test_more_than_the_invokes_raises_at_the_call(gpt2_model):
    with pytest.raises(BarrierError, match=r"waits for 3 invokes, but this trace runs 2") as info:
        with gpt2_model.trace() as tracer:
            barrier = tracer.barrier(3)
            with tracer.invoke(CLEAN):
                barrier()
            with tracer.invoke(CORRUPT):
                barrier()
    assert isinstance(info.value, ValueError) and isinstance(info.value, InterlaceError)
    assert "test_barrier.py" in str(info.value)  # where the barrier was made
    assert any(f.name.startswith("test_") for f in __import__("traceback").extract_tb(info.tb))


def test_an_invoke_ending_without_arriving_ends_the_wait(gpt2_model):
    ran = []
    with pytest.raises(BarrierError, match=r"can never fill: 1 of 2 \(invoke 0\) called it, and "
                                           r"invoke 1 ended without calling it"):
        with gpt2_model.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(CLEAN):
                h = gpt2_model.transformer.h[0].output
                barrier()
                ran.append("after")
            with tracer.invoke(CORRUPT):
                g = gpt2_model.transformer.h[1].output  # noqa: F841
    assert ran == []


def test_three_invokes_at_a_barrier_of_two(gpt2_model):
    """The third arrival starts a new round nobody else joins: an error, not a hang."""
    with pytest.raises(BarrierError, match=r"can never fill: 1 of 2 \(invoke 2\)"):
        with gpt2_model.trace() as tracer:
            barrier = tracer.barrier(2)
            for ids in (CLEAN, CORRUPT, CLEAN):
                with tracer.invoke(ids):
                    barrier()


def test_crossed_barriers_end_with_the_run(gpt2_model):
    """Invoke 0 waits at `a` before `b`, invoke 1 at `b` before `a`: both wait forever; the
    run ends and both learn why."""
    with pytest.raises(BarrierError, match=r"never filled: the model run ended while 1 of 2 "
                                           r"\(invoke 0\) waited"):
        with gpt2_model.trace() as tracer:
            a, b = tracer.barrier(2), tracer.barrier(2)
            with tracer.invoke(CLEAN):
                a()
                b()
            with tracer.invoke(CORRUPT):
                b()
                a()
    with torch.no_grad(), gpt2_model.trace(CLEAN):  # the model is clean: the next trace works
        logits = gpt2_model.lm_head.output.save()
    assert logits.shape == (1, 8, 1000)


def test_misuse(gpt2_model):
    with pytest.raises(BarrierError, match=r"is called inside the invoke bodies"):
        with gpt2_model.trace() as tracer:
            barrier = tracer.barrier(2)
            barrier()
            with tracer.invoke(CLEAN):
                pass
    with gpt2_model.trace(CLEAN) as tracer:
        kept = interlace.save(tracer.barrier(1))
    with pytest.raises(BarrierError, match=r"is called inside the invoke bodies"):
        kept()  # after the trace
    with pytest.raises(TypeError, match=r"number of invokes that meet there"):
        with gpt2_model.trace(CLEAN) as tracer:
            tracer.barrier(2.0)
    with pytest.raises(ValueError, match=r"n >= 1"):
        with gpt2_model.trace(CLEAN) as tracer:
            tracer.barrier(0)


def test_a_stop_releases_the_waiters(gpt2_model):
    with gpt2_model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CLEAN):
            h = gpt2_model.transformer.h[0].output.save()
            barrier()
        with tracer.invoke(CORRUPT):
            g = gpt2_model.transformer.h[1].output.save()
            tracer.stop()
    assert h.shape == g.shape == (1, 8, 64)


def test_a_run_with_barriers_is_freed_by_refcounting():
    from transformers import GPT2Config, GPT2LMHeadModel

    def run():
        module = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2,
                                            n_head=4, bos_token_id=0, eos_token_id=0)).eval()
        model = interlace.Model(module)
        refs = {"module": weakref.ref(module), "wrapper": weakref.ref(model)}
        for _ in range(2):
            with model.trace() as tracer:
                barrier = tracer.barrier(2)
                with tracer.invoke(CLEAN):
                    h = model.transformer.h[0].output[:, -1]
                    barrier()
                with tracer.invoke(CORRUPT):
                    barrier()
                    model.transformer.h[0].output[:, -1] = h
                    logits = model.lm_head.output.save()  # noqa: F841
            with pytest.raises(BarrierError):
                with model.trace() as tracer:
                    barrier = tracer.barrier(2)
                    with tracer.invoke(CLEAN):
                        barrier()
                    with tracer.invoke(CORRUPT):
                        g = model.transformer.h[0].output  # noqa: F841
        return refs

    assert_freed(run)
