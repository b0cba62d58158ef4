"""Memory: nothing accumulates over many traces, and nothing of a run is held after it.

- 10,000 traces that each save one output and drop it: nothing accumulates.
- Once the user lets go of the wrapper, the saved values (and any error), the module and
  every tensor of the run are freed by reference counting alone, whatever the run did
  (see `memcheck`), in the main thread and in a worker thread.
"""

import gc
import weakref

import pytest
import torch

import interlace

from .memcheck import assert_freed, collector_off, watch


def _rss_mib():
    """Resident MiB of live memory: with glibc, the free memory its allocator keeps is given
    back first (`malloc_trim`), so that what is measured is what is held, not where the heap
    happens to have grown (in steps of a few MiB, with the order of earlier tests)."""
    if _TRIM is not None:
        _TRIM(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    except OSError:  # not Linux: the object count still tells
        return 0.0


def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: RSS as it is
        return None


_TRIM = _malloc_trim()


def test_ten_thousand_traces_do_not_grow(mlp):
    model = interlace.Model(mlp)
    x = torch.randn(2, 6)

    def one():
        with torch.no_grad(), model.trace(x):
            h = model[2].output.save()
        return h

    for _ in range(300):  # warm-up: capture caches, worker pool, learned order
        one()
    gc.collect()
    objects, rss = len(gc.get_objects()), _rss_mib()
    for _ in range(10_000):
        one()
    gc.collect()
    # A leak of one object per trace would leave 10,000; a few made once meanwhile (a cache
    # filled lazily, another test's thread finishing) are not growth.
    assert len(gc.get_objects()) < objects + 100
    assert _rss_mib() - rss < 5.0


# -- freed by reference counting alone once the user lets go ---------------------------------
# Each case traces a fresh GPT-2 (from a small config) three times, keeping what it saved;
# when the run returns, the user's references (wrapper, module, saved values, any error)
# are gone. `assert_freed` checks with the cyclic collector off that the module, the
# wrapper, the saved values and every tensor of the run were freed.

IDS = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(3))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def _single(model):
    with model.trace(IDS):
        h = model.transformer.h[0].output.save()
        model.transformer.h[1].mlp.output[:] = 0
        logits = model.lm_head.output.save()
    return h, logits


def _invokes(model):
    with model.trace() as tracer:
        with tracer.invoke(IDS[:1]):
            h = model.transformer.h[0].output[:, -1].save()
        with tracer.invoke(IDS[1:]):
            model.transformer.h[0].output[:, -1] = h
            logits = model.lm_head.output.save()
    return h, logits


def _backward(model):
    with model.trace(IDS):
        h = model.transformer.h[0].output
        loss = model.lm_head.output.logsumexp(-1).mean()
        with loss.backward():
            g = h.grad.save()
    return (g,)


def _error_in_body(model):
    with pytest.raises(ValueError, match="boom"):
        with model.trace(IDS):
            h = model.transformer.h[0].output.save()  # noqa: F841
            raise ValueError("boom")
    return ()


def _out_of_order(model):
    with pytest.raises(interlace.OutOfOrderError):
        with model.trace(IDS):
            h = model.transformer.h[1].output.save()  # noqa: F841
            model.transformer.h[0].output  # noqa: B018
    return ()


def _out_of_order_caught_in_body(model):
    with model.trace(IDS):
        h = model.transformer.h[1].output.save()
        try:
            model.transformer.h[0].output  # noqa: B018
        except interlace.OutOfOrderError:
            pass
        logits = model.lm_head.output.save()
    return h, logits


def _error_in_backward_body(model):
    with pytest.raises(ValueError, match="boom"):
        with model.trace(IDS):
            h = model.transformer.h[0].output
            loss = model.lm_head.output.sum()
            with loss.backward():
                g = h.grad.save()  # noqa: F841
                raise ValueError("boom")
    return ()


def _keyboard_interrupt_in_body(model):
    with pytest.raises(KeyboardInterrupt):
        with model.trace(IDS):
            h = model.transformer.h[0].output.save()  # noqa: F841
            raise KeyboardInterrupt()
    return ()


def _keyboard_interrupt_from_a_hook(model):
    def interrupt(module, args, output):
        raise KeyboardInterrupt()

    handle = model.transformer.h[1]._module.register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with model.trace(IDS):
                h = model.transformer.h[0].output.save()  # noqa: F841
                logits = model.lm_head.output.save()  # noqa: F841 - parked when it hits
    finally:
        handle.remove()
    return ()


def _stop(model):
    with model.trace(IDS) as tracer:
        h = model.transformer.h[0].output.save()
        tracer.stop()
    return (h,)


def _skip(model):
    with model.trace(IDS):
        model.transformer.h[1].skip(model.transformer.h[0].output)
        logits = model.lm_head.output.save()
    return (logits,)


def _iter_cut_short(model):
    with pytest.warns(interlace.IterationCutShortWarning):
        with model.trace(IDS) as tracer:
            steps = [].save()
            for _ in tracer.iter[:3]:
                steps.append(model.lm_head.output)
    return steps


def _attachment(model):
    mlp = model.transformer.h[0].mlp
    if not hasattr(mlp, "adapter"):  # attached after wrapping, applied by an edit (attach.py)
        mlp.adapter = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 64))
    with model.edit() as edited:
        m = edited.transformer.h[0].mlp
        m.output = m.adapter(m.output, hook=True)
    with model.trace() as tracer:  # (the unedited wrapper, then the edited one)
        with tracer.invoke(IDS[:1]):
            plain = model.lm_head.output.save()
    with edited.trace() as tracer:
        with tracer.invoke(IDS[:1]):
            inner = edited.transformer.h[0].mlp.adapter[0].output.save()
        with tracer.invoke(IDS[1:]):
            logits = edited.lm_head.output.save()
    return plain, inner, logits


def _attachment_raises(model):
    mlp = model.transformer.h[0].mlp
    if not hasattr(mlp, "wrong"):  # an attachment whose forward raises (shapes do not fit)
        mlp.wrong = torch.nn.Linear(7, 7)
    with pytest.raises(RuntimeError):
        with model.trace(IDS):
            h = model.transformer.h[0].mlp.output
            model.transformer.h[0].mlp.wrong(h, hook=True)
    return ()


CASES = {f.__name__.lstrip("_"): f for f in (
    _single, _invokes, _backward, _error_in_body, _out_of_order, _out_of_order_caught_in_body,
    _error_in_backward_body, _keyboard_interrupt_in_body, _keyboard_interrupt_from_a_hook,
    _stop, _skip, _iter_cut_short, _attachment, _attachment_raises,
)}


def _traced(case):
    def run():
        module = _gpt2()
        model = interlace.Model(module)
        refs = {"module": weakref.ref(module), "wrapper": weakref.ref(model)}
        kept = []
        for i in range(3):
            saved = case(model)
            kept.append(saved)
            watch(refs, f"saved by trace {i}", saved)
        assert i == 2 and len(kept) == 3
        return refs

    return run


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_run_is_freed_by_refcounting_once_the_user_lets_go(case, where):
    assert_freed(_traced(CASES[case]), where)


def test_a_wrapped_model_is_not_a_reference_cycle(gpt2):
    """Walking the Envoy tree and dropping the wrapper frees every Envoy at once."""
    with collector_off():
        model = interlace.Model(gpt2)
        leaf = model.transformer.h[1].mlp.c_fc
        refs = [weakref.ref(model), weakref.ref(leaf), weakref.ref(model.transformer.h)]
        del model, leaf
        assert [r() for r in refs] == [None, None, None]


# -- a tracer kept after its block does not keep the model alive (nnsight frees it too) --------
# Each case returns what the user keeps (tracers, caches, the error) and what it saved; the
# model must be freed anyway, with the collector off, while those are still held.


def _kept_tracer(model):
    with model.trace(IDS) as tracer:
        h = model.transformer.h[0].output.save()
    return [tracer], h


def _kept_invoke_tracers(model):
    invokers = []
    with model.trace() as tracer:
        with tracer.invoke(IDS[:1]) as first:
            h = model.transformer.h[0].output.save()
        with tracer.invoke(IDS[1:]) as second:
            logits = model.lm_head.output.save()
        invokers.extend([first, second])
    return [tracer, *invokers], (h, logits)


def _kept_tracer_body_raised(model):
    with pytest.raises(ValueError, match="boom"):
        with model.trace(IDS) as tracer:
            model.transformer.h[0].output.save()
            raise ValueError("boom")
    return [tracer], ()


def _kept_cache(model):
    with model.trace(IDS) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[0], model.lm_head])
    return [tracer, cache], [cache["model.transformer.h.0"].output[0], cache["model.lm_head"].output]


KEPT = {f.__name__.lstrip("_"): f for f in (
    _kept_tracer, _kept_invoke_tracers, _kept_tracer_body_raised, _kept_cache,
)}


@pytest.mark.parametrize("case", sorted(KEPT))
def test_a_kept_tracer_does_not_keep_the_model(case):
    held = []  # what the user keeps: alive while the check runs

    def run():
        held.clear()
        module = _gpt2()
        model = interlace.Model(module)
        refs = {"module": weakref.ref(module), "wrapper": weakref.ref(model)}
        for _ in range(2):
            kept, saved = KEPT[case](model)
            held.append((kept, saved))
        return refs

    run()  # once before: what torch and transformers build lazily on first use
    gc.collect()
    with collector_off():
        refs = run()
        alive = sorted(name for name, ref in refs.items() if ref() is not None)
        assert not alive, f"a kept tracer keeps the model alive (the collector is off): {alive}"
        assert held and all(kept for kept, _ in held)


def test_a_kept_tracer_still_has_the_result_and_the_cache_its_values(gpt2):
    """What the run produced stays with the tracer and the cache; the model is dropped."""
    model = interlace.Model(gpt2)
    with model.trace(IDS) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[0]])
    expected = gpt2(IDS)
    hidden = []
    handle = gpt2.transformer.h[0].register_forward_hook(lambda m, a, out: hidden.append(out[0]))
    try:
        gpt2(IDS)
    finally:
        handle.remove()
    assert torch.equal(tracer.result.logits, expected.logits)
    assert torch.equal(cache["model.transformer.h.0"].output[0], hidden[0])
    assert tracer.model is None
