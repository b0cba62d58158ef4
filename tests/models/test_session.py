"""`LanguageModel.session()`: a generation's ids and activations feed later traces.

Reference: transformers' own `generate` and forward on the same weights, with plain hooks.
"""

import torch

from conftest import StepHooks, encode, layers

PROMPT = "the capital of france is"


def test_a_trace_reads_what_an_earlier_generation_produced(lm, hf_model, hf_tokenizer, arch):
    with torch.no_grad(), lm.session():
        with lm.generate(PROMPT, max_new_tokens=4, do_sample=False) as gen:
            first = layers(lm, arch)[0].output[:, -1]  # step 0: the prompt pass
            ids = gen.result  # not saved: the session keeps it for the next trace
        with lm.trace(ids):
            layers(lm, arch)[1].output[:, -1] = first
            logits = lm.lm_head.output[:, -1].save()
        n = ids.shape[1]
        kept = [n].save()
    prompt = encode(hf_tokenizer, PROMPT)
    with torch.no_grad():
        ref_ids = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                    pad_token_id=hf_tokenizer.eos_token_id, do_sample=False)
        with StepHooks(layers(hf_model, arch)[0]) as seen:
            hf_model(prompt)

        def patch(step, out):
            out = out.clone()
            out[:, -1] = seen.outputs[0][:, -1]
            return out

        with StepHooks(layers(hf_model, arch)[1], patch):
            ref = hf_model(ref_ids).logits[:, -1]
        plain = hf_model(ref_ids).logits[:, -1]
    assert kept == [ref_ids.shape[1]]
    torch.testing.assert_close(logits, ref)
    assert not torch.allclose(logits, plain, atol=1e-3)
