"""`tracer.iter[...]` / `tracer.all()` seed semantics during generation.

Reference: plain forward hooks on the same module during transformers' `generate`, which
record the module's output at every call (one call per generated token = one step).
"""

import gc
import warnings

import pytest
import torch
from greenlet import greenlet

from conftest import StepHooks, encode, layers

import interlace
from interlace import IterationCutShortWarning, OutOfOrderError

PROMPT = "the capital of france is"
N = 4  # tokens generated: steps 0..3


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):
    """lm_head's output at each of the N steps of a greedy generation."""
    ids = encode(hf_tokenizer, PROMPT)
    with torch.no_grad(), StepHooks(hf_model.lm_head) as hooks:
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                          do_sample=False, pad_token_id=hf_tokenizer.eos_token_id)
    assert len(hooks.outputs) == N
    return hooks.outputs


def generate(lm, n=N):
    return lm.generate(PROMPT, max_new_tokens=n, do_sample=False)


def no_suspended_body():
    """No greenlet is parked inside a test body (pooled idle workers are fine)."""
    for obj in gc.get_objects():
        if issubclass(type(obj), greenlet) and obj.gr_frame is not None:
            frame = obj.gr_frame
            while frame is not None:
                assert frame.f_code.co_filename != __file__, "a trace body was left suspended"
                frame = frame.f_back
    return True


def check_steps(values, reference, steps):
    assert len(values) == len(steps)
    for value, step in zip(values, steps):
        torch.testing.assert_close(value, reference[step])


@pytest.mark.parametrize(
    "make, steps",
    [
        (lambda t: t.iter[:3], [0, 1, 2]),
        (lambda t: t.iter[1:3], [1, 2]),
        (lambda t: t.iter[2], [2]),
        (lambda t: t.iter[[0, 2, 3]], [0, 2, 3]),
        (lambda t: t.iter[0:4:2], [0, 2]),
        (lambda t: t.iter[[1]], [1]),
    ],
    ids=["[:3]", "[1:3]", "[2]", "[[0,2,3]]", "[0:4:2]", "[[1]]"],
)
def test_bounded_forms_bind_each_step(lm, reference, make, steps):
    with generate(lm) as tracer:
        seen = interlace.save([])
        bound = interlace.save([])
        for step in make(tracer):
            bound.append(step)
            seen.append(lm.lm_head.output)
        after = tracer.result.save()  # code after a completed loop runs
    assert bound == steps
    check_steps(seen, reference, steps)
    assert after.shape[1] == encode(lm.tokenizer, PROMPT).shape[1] + N


def test_skipped_steps_still_advance_the_count(lm, reference):
    """iter[[0, 2]]: index 2 binds the third occurrence even though step 1 was not selected."""
    with generate(lm) as tracer:
        seen = interlace.save([])
        for step in tracer.iter[[0, 2]]:
            seen.append(lm.lm_head.output)
    check_steps(seen, reference, [0, 2])
    assert not torch.allclose(seen[1], reference[1], atol=1e-4)  # step 2 really is not step 1


@pytest.mark.parametrize("form", ["iter[:]", "all()", "iter[1:]"])
def test_open_end_runs_until_the_model_stops(lm, reference, form):
    start = 1 if form == "iter[1:]" else 0
    ran_after = []
    with pytest.warns(IterationCutShortWarning, match=rf"step {N} of model.lm_head.output was never reached") as record:
        with generate(lm) as tracer:
            seen = interlace.save([])
            loop = tracer.all() if form == "all()" else tracer.iter[start:]
            for step in loop:
                seen.append(lm.lm_head.output)
            ran_after.append(True)
    check_steps(seen, reference, list(range(start, N)))
    assert ran_after == []  # code after a cut-short loop does not run
    assert len(record) == 1
    assert record[0].filename == __file__  # points at the user's request line
    assert no_suspended_body()


@pytest.mark.parametrize(
    "make, kept",
    [
        (lambda t: t.iter[:10], [0, 1, 2, 3]),
        (lambda t: t.iter[7], []),
        (lambda t: t.iter[[0, 9]], [0]),
        (lambda t: t.iter[2:9:3], [2]),
    ],
    ids=["[:10]", "[7]", "[[0,9]]", "[2:9:3]"],
)
def test_named_end_the_run_cannot_supply_is_cut_short(lm, reference, make, kept):
    ran_after = []
    with pytest.warns(IterationCutShortWarning) as record:
        with generate(lm) as tracer:
            seen = interlace.save([])
            last = None
            for step in make(tracer):
                seen.append(lm.lm_head.output)
                last = interlace.save(step)
            ran_after.append(True)
    check_steps(seen, reference, kept)
    assert ran_after == []
    if kept:
        assert last == kept[-1]  # a value saved inside the loop is kept
    message = str(record[0].message)
    assert isinstance(record[0].message, UserWarning)
    assert "cut short" in message
    assert "values saved in earlier steps are kept" in message
    assert "code after the loop did not run" in message
    assert "min_new_tokens=" in message
    assert no_suspended_body()
    # The model is clean: the next generation works and is complete.
    with generate(lm) as tracer:
        ids = tracer.result.save()
    assert ids.shape[1] == encode(lm.tokenizer, PROMPT).shape[1] + N


def test_min_new_tokens_pins_the_generation_to_the_loop(lm, hf_model, hf_tokenizer):
    """What the warning suggests works: eos cannot end generation before min_new_tokens."""
    ids = encode(hf_tokenizer, PROMPT)
    plain = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              do_sample=False, pad_token_id=0)
    eos = int(plain[0, ids.shape[1] + 1])  # make the 2nd generated token end generation
    with pytest.warns(IterationCutShortWarning, match="min_new_tokens="):
        with lm.generate(PROMPT, max_new_tokens=6, eos_token_id=eos, do_sample=False) as tracer:
            short = interlace.save([])
            for step in tracer.iter[:6]:
                short.append(lm.lm_head.output)
    assert len(short) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lm.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, eos_token_id=eos,
                         do_sample=False) as tracer:
            full = interlace.save([])
            for step in tracer.iter[:6]:
                full.append(lm.lm_head.output)
    assert len(full) == 6


def test_cut_short_warning_can_be_filtered(lm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IterationCutShortWarning)
        with generate(lm) as tracer:
            seen = interlace.save([])
            for step in tracer.iter[:]:
                seen.append(lm.lm_head.output)
    assert len(seen) == N
    assert issubclass(IterationCutShortWarning, UserWarning)


def test_loops_nest_and_restore_the_pointer(lm, reference, arch, hf_model, hf_tokenizer):
    ids = encode(hf_tokenizer, PROMPT)
    with torch.no_grad(), StepHooks(layers(hf_model, arch)[0]) as h0:
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                          do_sample=False, pad_token_id=0)
    with generate(lm) as tracer:
        inner = interlace.save([])
        outer = interlace.save([])
        for step in tracer.iter[1:3]:
            for same in tracer.iter[[step]]:
                inner.append(layers(lm, arch)[0].output)
            outer.append(lm.lm_head.output)  # after the inner loop: still the outer step
    check_steps(inner, h0.outputs, [1, 2])
    check_steps(outer, reference, [1, 2])


def test_edits_inside_the_loop_match_plain_hooks(lm, hf_model, hf_tokenizer, arch):
    ids = encode(hf_tokenizer, PROMPT)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    plain = hf_model.generate(ids, **kwargs)
    with StepHooks(layers(hf_model, arch)[0].mlp, lambda s, o: o * 0 if s in (2, 3) else None):
        ref = hf_model.generate(ids, **kwargs)
    with lm.generate(PROMPT, max_new_tokens=6, do_sample=False) as tracer:
        for step in tracer.iter[2:4]:
            layers(lm, arch)[0].mlp.output[:] = 0
        out = tracer.result.save()
    assert torch.equal(out, ref)
    assert not torch.equal(out, plain)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda t: t.iter[-1], ValueError, r"tracer.iter\[-1\]: negative steps are not allowed \(got -1\)"),
        (lambda t: t.iter[-2:], ValueError, r"negative steps are not allowed \(got -2\)"),
        (lambda t: t.iter[:-1], ValueError, r"negative steps are not allowed \(got -1\)"),
        (lambda t: t.iter[[0, -3]], ValueError, r"negative steps are not allowed \(got -3\)"),
        (lambda t: t.iter[::-1], ValueError, r"the step of the slice must be positive"),
        (lambda t: t.iter["a"], TypeError, r"tracer.iter\[...\] takes a step \(int\), a slice"),
        (lambda t: t.iter[1.5], TypeError, r"not float"),
        (lambda t: t.iter[[0, "x"]], TypeError, r"takes a list of int steps, got str 'x'"),
    ],
)
def test_bad_selectors(lm, make, error, message):
    with pytest.raises(error, match=message):
        with generate(lm) as tracer:
            for step in make(tracer):
                lm.lm_head.output.save()
    assert no_suspended_body()


def test_iter_outside_a_running_body(lm):
    with generate(lm) as tracer:
        ids = tracer.result.save()
    assert ids.shape[0] == 1
    with pytest.raises(interlace.InterlaceError, match=r"tracer.iter\[:2\] works only inside the body"):
        for step in tracer.iter[:2]:
            pass


def test_open_loop_asking_for_nothing_is_an_error(lm):
    with pytest.raises(interlace.InterlaceError, match=r"tracer.iter\[:\]: 10000 steps in a row asked the model for nothing"):
        with generate(lm) as tracer:
            for step in tracer.iter[:]:
                pass
    assert no_suspended_body()


def test_open_loop_may_skip_steps(lm, reference):
    with pytest.warns(IterationCutShortWarning):
        with generate(lm) as tracer:
            seen = interlace.save([])
            for step in tracer.iter[:]:
                if step % 2 == 1:
                    seen.append(lm.lm_head.output)
    check_steps(seen, reference, [1, 3])


def test_outside_iter_a_location_that_never_runs_is_out_of_order(gpt2_lm):
    """GPT-2's attn_dropout module is never called under SDPA attention (only its p is used)."""
    lm = gpt2_lm
    with pytest.raises(OutOfOrderError, match=r"model.transformer.h.0.attn.attn_dropout.output \(occurrence 0\) was never produced"):
        with generate(lm):
            lm.transformer.h[0].attn.attn_dropout.output.save()
    assert no_suspended_body()


def test_deprecated_with_form_reruns_the_block_per_step(lm, reference):
    with pytest.warns(DeprecationWarning, match=r"`with tracer.iter\[:3\]:` is deprecated.*for step in tracer.iter\[:3\]:") as record:
        with generate(lm) as tracer:
            seen = interlace.save([])
            count = 0
            with tracer.iter[:3]:
                seen.append(lm.lm_head.output)
                count = count + 1
            total = interlace.save(count)
    assert record[0].filename == __file__
    check_steps(seen, reference, [0, 1, 2])
    assert total == 3  # each step saw the previous step's assignment


def test_deprecated_open_with_form_keeps_reached_steps(lm, reference):
    with pytest.warns(DeprecationWarning, match=r"`with tracer.all\(\):` is deprecated.*`for step in tracer.all\(\):`"), \
            pytest.warns(IterationCutShortWarning, match="cut short"):
        with generate(lm) as tracer:
            seen = interlace.save([])
            with tracer.all():
                seen.append(lm.lm_head.output)
    check_steps(seen, reference, list(range(N)))
    assert no_suspended_body()


def test_iter_on_a_plain_trace_pins_repeated_modules(lm, hf_model, hf_tokenizer):
    """One forward pass: iter[0] is the only step; iter[:2] is cut short after it."""
    ids = encode(hf_tokenizer, PROMPT)
    with torch.no_grad():
        ref = hf_model(ids).logits
    with pytest.warns(IterationCutShortWarning, match="step 1 of model.lm_head.output"):
        with lm.trace(PROMPT) as tracer:
            seen = interlace.save([])
            for step in tracer.iter[:2]:
                seen.append(lm.lm_head.output)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], ref)


def test_pointer_is_restored_after_the_loop(lm, reference):
    """After the loop the pointer is what it was before (step 0): a read binds to step 0 again,
    which has passed by then -- an OutOfOrderError, not a silent read of the next step."""
    inside = []
    with pytest.raises(OutOfOrderError, match=r"model.lm_head.output \(occurrence 0\) was requested after"):
        with generate(lm) as tracer:
            for step in tracer.iter[1:2]:
                inside.append(lm.lm_head.output)
            lm.lm_head.output.save()
    check_steps(inside, reference, [1])
    assert no_suspended_body()
