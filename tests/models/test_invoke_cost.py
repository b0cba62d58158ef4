"""An invoke's own cost: what a `LanguageModel` trace does per invoke that it could do once.

Issue 20's `invokes` workload (16 invokes of one tensor of ids each, reading a block) pays
interlace's steps per invoke; the harness times it. Here, what a regression would show
without timing: the Python calls of the engine's and the language model's own code
(`intervention/`, `models/`: policy, the same on the compiled path and its twin) per further
invoke, on a trace whose values equal each prompt run alone with a plain hook. (Splitting
each prompt into rows and stacking them back, as the prompt preparation did before, made it
31 calls an invoke.)
"""

import os
import sys

import pytest
import torch

from conftest import layers

from interlace.models import inputs

PER_INVOKE_BOUND = 10  # 3 now (8 with generator bodies off); a tensor of ids per invoke has no prompt step (PromptBatcher.batch_invokes)
_OURS = tuple(os.sep + os.path.join("interlace", part) + os.sep for part in ("intervention", "models"))


def _run(lm, arch, rows):
    outs = []
    with torch.no_grad(), lm.trace() as tracer:
        for row in rows:
            with tracer.invoke(row):
                outs.append(layers(lm, arch)[0].output.save())
    return outs


def _calls(fn):
    """(fn's result, Python calls of `intervention/` and `models/` while it ran)."""
    count = 0
    seen = set()  # frames met: a generator's resumption is not a call
    frames = []  # (held, so that an id is not reused by a later frame)

    def profile(frame, event, arg):
        nonlocal count
        if event != "call" or id(frame) in seen:
            return
        seen.add(id(frame))
        frames.append(frame)
        if any(part in frame.f_code.co_filename for part in _OURS):
            count += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(previous)
    return out, count


def test_a_further_invoke_costs_a_bounded_number_of_calls_and_each_equals_its_prompt_alone(lm, hf_model, arch):
    rows = [torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(i)) for i in range(10)]
    for _ in range(3):  # warm: the invokes' sites audited, then run as generators
        _run(lm, arch, rows[:2])
        _run(lm, arch, rows)
    few, calls_few = _calls(lambda: _run(lm, arch, rows[:2]))
    many, calls_many = _calls(lambda: _run(lm, arch, rows))
    per_invoke = (calls_many - calls_few) / (len(rows) - 2)
    assert per_invoke <= PER_INVOKE_BOUND, per_invoke
    block = layers(hf_model, arch)[0]
    for row, got in zip(rows, many):
        seen = []
        handle = block.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
        try:
            with torch.no_grad():
                hf_model(row)
        finally:
            handle.remove()
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, seen[0])
    for a, b in zip(few, many):
        torch.testing.assert_close(a, b)


def _model_inputs(lm, invokes):
    """The keyword inputs the model's forward received in a trace of `invokes` (each a
    tuple of positional inputs), and each invoke's layer-0 output."""
    seen = {}
    handle = lm._module.register_forward_pre_hook(
        lambda m, a, k: seen.update({name: v.clone() for name, v in k.items() if torch.is_tensor(v)}),
        with_kwargs=True)
    outs = []
    try:
        with torch.no_grad(), lm.trace() as tracer:
            for args in invokes:
                with tracer.invoke(*args):
                    outs.append(lm.lm_head.output.save())
    finally:
        handle.remove()
    return seen, outs


def test_invokes_of_one_tensor_of_ids_each_are_batched_with_no_step_per_invoke(gpt2_lm, monkeypatch):
    """`tracer.invoke(ids)` in a loop, every `ids` a 2-D int64 tensor of one width (some of
    several rows): batched by the language model's shortcut (`PromptBatcher.batch_invokes`:
    no `prepare` per invoke), giving the model what the prepared path gives it, and each
    invoke the logits of its tensor run alone."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(0, 300, (rows, 6), generator=g) for rows in (1, 3, 1, 2)]
    invokes = [(t,) for t in tensors]
    _model_inputs(gpt2_lm, invokes)  # warm: the sites audited
    prepares = []
    real_prepare = inputs.PromptBatcher.prepare
    monkeypatch.setattr(inputs.PromptBatcher, "prepare", lambda self, *a: prepares.append(a) or real_prepare(self, *a))
    fast, outs = _model_inputs(gpt2_lm, invokes)
    assert prepares == []  # the shortcut took them: no step per invoke
    monkeypatch.setattr(inputs.PromptBatcher, "batch_invokes", lambda self, invokes: None)
    slow, slow_outs = _model_inputs(gpt2_lm, invokes)
    assert len(prepares) == len(invokes)  # (the prepared path, for reference)
    assert fast.keys() == slow.keys() >= {"input_ids", "attention_mask"}
    for name in fast:
        assert torch.equal(fast[name], slow[name]), name
    module = gpt2_lm._module
    for t, got, ref in zip(tensors, outs, slow_outs):
        with torch.no_grad():
            alone = module(t).logits
        torch.testing.assert_close(got, alone)
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("case", ["widths differ", "int32 ids", "1-D ids", "an empty tensor", "a keyword",
                                  "two inputs", "a list of ids", "a string"])
def test_invokes_the_shortcut_declines_go_the_prepared_way(gpt2_lm, monkeypatch, case):
    """Anything but one non-empty 2-D int64 tensor of one width per invoke is the prepared
    path's, with its padding, conversions and errors: the same with the shortcut as without."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 300, (1, 6), generator=g)
    other = {
        "widths differ": ((torch.randint(0, 300, (1, 4), generator=g),), {}),
        "int32 ids": ((ids.to(torch.int32),), {}),
        "1-D ids": ((ids[0],), {}),
        "an empty tensor": ((ids[:0],), {}),
        "a keyword": ((ids,), {"attention_mask": torch.ones_like(ids)}),
        "two inputs": ((ids, ids), {}),
        "a list of ids": ((ids[0].tolist(),), {}),
        "a string": (("hello there",), {}),
    }[case]

    def run():
        try:
            with torch.no_grad(), gpt2_lm.trace() as tracer:
                with tracer.invoke(ids):
                    first = gpt2_lm.lm_head.output.save()
                with tracer.invoke(*other[0], **other[1]):
                    second = gpt2_lm.lm_head.output.save()
        except Exception as error:  # noqa: BLE001 - compared below
            return type(error), str(error).split("\n")[0]
        return first, second

    declined = []
    real = inputs.PromptBatcher.batch_invokes
    monkeypatch.setattr(inputs.PromptBatcher, "batch_invokes",
                        lambda self, invokes: declined.append(real(self, invokes)) or declined[-1])
    got = run()
    assert declined == [None]  # asked, and it declined
    monkeypatch.setattr(inputs.PromptBatcher, "batch_invokes", lambda self, invokes: None)
    ref = run()
    if isinstance(ref[0], type):  # an error: the same one
        assert got == ref
    else:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)
