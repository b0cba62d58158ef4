"""Generation sweeps: `generate=True` runs `generate` per batch; each item as if alone.

Reference: `lm.generate(prompt, ...)` per item with the same body (`tracer.result` for
`sweep.output`, `tracer.iter` for `sweep.iter`).
"""

import pytest
import torch

from interlace import IterationCutShortWarning

from .conftest import Calls

GREEDY = {"do_sample": False}
PROMPTS = ["hello world", "the capital of", "a b c", "the quick", "once upon a time", "rome is"]


def test_generated_ids_and_steered_steps_equal_each_prompt_alone(lm):
    with Calls(lm._module) as calls:
        with torch.no_grad(), lm.sweep(PROMPTS, generate=True, max_new_tokens=4, batch_size=4,
                                       progress=False, **GREEDY) as sweep:
            logits = [].save()
            for step in sweep.iter[:4]:
                if step == 1:
                    lm.transformer.h[0].mlp.output[:] = 0
                logits.append(lm.lm_head.output[:, -1])
            ids = sweep.output.save()
    assert len(calls.sizes) < 4 * len(PROMPTS)  # prompts of one length share a generation
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad(), lm.generate(prompt, max_new_tokens=4, **GREEDY) as tracer:
            alone = [].save()
            for step in tracer.iter[:4]:
                if step == 1:
                    lm.transformer.h[0].mlp.output[:] = 0
                alone.append(lm.lm_head.output[:, -1])
            alone_ids = tracer.result.save()
        assert torch.equal(ids[i], alone_ids)
        assert len(logits[i]) == len(alone) == 4
        for a, b in zip(logits[i], alone):
            torch.testing.assert_close(a, b)
        with torch.no_grad(), lm.generate(prompt, max_new_tokens=4, **GREEDY) as tracer:
            plain = tracer.result.save()
        assert not torch.equal(plain, alone_ids) or i > 0  # the steering changes some output


def test_an_item_whose_generation_ends_early_sees_only_its_own_steps(lm, tokenizer):
    """eos for one prompt at step 1: alone it stops there; in its batch the others go on."""
    same_length = [p for p in PROMPTS if len(tokenizer(p)["input_ids"]) == 3][:3]
    assert len(same_length) >= 2
    with torch.no_grad(), lm.generate(same_length[0], max_new_tokens=5, **GREEDY) as tracer:
        first = tracer.result.save()
    n = len(tokenizer(same_length[0])["input_ids"])
    eos = int(first[0, n + 1])  # the token prompt 0 produces at step 1 ends its generation
    kwargs = dict(max_new_tokens=5, eos_token_id=eos, **GREEDY)

    def alone(prompt):
        with torch.no_grad(), lm.generate(prompt, **kwargs) as tracer:
            ids = tracer.result.save()
        with torch.no_grad(), lm.generate(prompt, **kwargs) as tracer:
            steps = [].save()
            for step in tracer.iter[:5]:
                steps.append(step)
                top = lm.lm_head.output[:, -1].argmax(-1)  # noqa: F841
        return ids, steps

    references = []
    for prompt in same_length:
        with pytest.warns(IterationCutShortWarning) if prompt == same_length[0] else _nothing():
            references.append(alone(prompt))
    with torch.no_grad(), lm.sweep(same_length, generate=True, batch_size=3, progress=False,
                                   **kwargs) as sweep:
        ids = sweep.output.save()
    with pytest.warns(IterationCutShortWarning):  # item 0's solo rerun warns as alone
        with torch.no_grad(), lm.sweep(same_length, generate=True, batch_size=3,
                                       progress=False, **kwargs) as sweep:
            steps = [].save()
            for step in sweep.iter[:5]:
                steps.append(step)
                top = lm.lm_head.output[:, -1].argmax(-1)  # noqa: F841
    for i, (alone_ids, alone_steps) in enumerate(references):
        assert torch.equal(ids[i], alone_ids)
        assert steps[i] == alone_steps
    # item 0 ended early while another item of its batch went on
    assert ids[0].shape[1] <= n + 2 and max(i.shape[1] for i in ids) > ids[0].shape[1]
    assert len(steps[0]) < max(len(s) for s in steps)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
