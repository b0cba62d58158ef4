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

import torch

from conftest import layers

PER_INVOKE_BOUND = 15  # 11 now (14 with generator bodies off): the invoke, its tracer and backend, job, route, prompt, h[0], end
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
