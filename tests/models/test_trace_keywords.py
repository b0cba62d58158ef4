"""LanguageModel.trace's keywords: split into the prompt and the forward's own, and checked,
only when there are any (a prompt alone, the usual call, pays for neither)."""

import sys

import pytest
import torch

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
    assert names == ["trace", "__init__"]


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
