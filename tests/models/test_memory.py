"""A LanguageModel is freed by reference counting alone once the user lets go, after
generation with `tracer.iter`, a loop cut short, batched prompts and plain traces
(see tests/intervention/memcheck.py for how "freed" is checked)."""

import weakref

import pytest

from conftest import layers

import interlace
from intervention.memcheck import assert_freed, watch

PROMPT = "the capital of france is"


def _generate_iter(lm):
    with lm.generate(PROMPT, max_new_tokens=4, do_sample=False) as tracer:
        logits = [].save()
        for step in tracer.iter[:4]:
            logits.append(lm.lm_head.output[:, -1])
            if step == 2:
                layers(lm, "gpt2")[0].mlp.output[:] = 0
        ids = tracer.result.save()
    assert len(logits) == 4
    return [*logits, ids]


def _generate_cut_short(lm):
    with pytest.warns(interlace.IterationCutShortWarning):
        with lm.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            logits = [].save()
            for _ in tracer.iter[:5]:
                logits.append(lm.lm_head.output[:, -1])
    assert len(logits) == 2
    return logits


def _generate_invokes(lm):
    with lm.generate(max_new_tokens=3, do_sample=False) as tracer:
        with tracer.invoke("hello world"):
            a = lm.lm_head.output.save()
        with tracer.invoke(PROMPT):
            b = lm.lm_head.output.save()
    return a, b, tracer.result


def _trace_prompts(lm):
    with lm.trace(["hello", PROMPT]):
        h = layers(lm, "gpt2")[1].output.save()
        logits = lm.lm_head.output.save()
    return h, logits


CASES = {f.__name__.lstrip("_"): f for f in (
    _generate_iter, _generate_cut_short, _generate_invokes, _trace_prompts,
)}


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_language_model_is_freed_by_refcounting(model_dirs, case, where):
    def run():
        lm = interlace.LanguageModel(model_dirs["gpt2"])
        refs = {"module": weakref.ref(lm._module), "wrapper": weakref.ref(lm)}
        kept = [CASES[case](lm) for _ in range(2)]
        for i, saved in enumerate(kept):
            watch(refs, f"saved by run {i}", saved)
        return refs

    assert_freed(run, where)


def test_a_kept_generation_tracer_does_not_keep_the_model(model_dirs):
    """`as tracer` kept after a generation (and an invoke's tracer): the model is freed anyway,
    and `tracer.result` (the generated ids) stays."""
    import gc

    from intervention.memcheck import collector_off

    held = []

    def run():
        held.clear()
        lm = interlace.LanguageModel(model_dirs["gpt2"])
        refs = {"module": weakref.ref(lm._module), "wrapper": weakref.ref(lm)}
        with lm.generate(max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            with tracer.invoke(PROMPT) as invoker:
                logits = lm.lm_head.output.save()
            held.append(invoker)
        held.extend([tracer, len(lm.tokenizer(PROMPT)["input_ids"])])
        return refs

    run()
    gc.collect()
    with collector_off():
        refs = run()
        assert [name for name, ref in refs.items() if ref() is not None] == []
    tracer, prompt_length = held[1], held[2]
    assert tracer.result.shape == (1, prompt_length + 2)  # the prompt, then 2 new ids
