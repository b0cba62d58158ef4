"""LanguageModel.trace's keywords: split into the prompt and the forward's own, and checked,
only when there are any (a prompt alone, the usual call, pays for neither)."""

import sys

import pytest
import torch

import interlace

from conftest import encode


def _python_calls(fn, *args):
    """The names of the Python functions `fn(*args)` runs, in call order."""
    names = []

    def profile(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, names


def test_a_prompt_alone_runs_no_keyword_step(lm):
    ids = encode(lm.tokenizer, "hello")
    lm.trace(ids).release()
    tracer, names = _python_calls(lm.trace, ids)
    tracer.release()
    # (compiled, the tracer is made with no Python frame: hotpath.tracer_maker; the twin runs
    # its one closure, the same steps)
    assert names == ([] if interlace.native else ["trace"])


def test_keywords_are_still_split_and_checked(lm, hf_model):
    ids = encode(lm.tokenizer, "hello world")
    with torch.no_grad():
        with lm.trace(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True) as tracer:
            out = tracer.result.save()
        expected = hf_model(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, expected.logits)
    assert len(out.hidden_states) == len(expected.hidden_states)
    with pytest.raises(TypeError, match=r"forward does not take 'temprature'"):
        lm.trace(ids, temprature=0.5)
    with pytest.raises(TypeError, match="position_ids"):
        lm.trace(ids, position_ids=torch.arange(ids.shape[1])[None])


def test_the_compiled_trace_makes_the_tracer_the_python_method_makes(lm):
    """`trace(*inputs)` with no keyword is made by `hotpath.tracer_maker`; the method it stands
    for (`__wrapped__`, what every other call runs) makes the same tracer: same class, the
    same fields in the same order, the same values."""
    ids = encode(lm.tokenizer, "hello")
    fast, slow = lm.trace(ids), type(lm).trace.__wrapped__(lm, ids)
    try:
        assert type(fast) is type(slow)
        assert list(vars(fast)) == list(vars(slow))
        for name in ("model", "engine", "_run", "_batcher", "backend", "block"):
            assert getattr(fast, name) is getattr(slow, name), name
        assert len(fast.args) == 1 and fast.args[0] is slow.args[0] is ids
        assert fast.kwargs == slow.kwargs == {}
    finally:
        fast.release()
        slow.release()
