"""LanguageModel.trace: prompts in every form, batching across invokes, reads and edits.

References: the plain transformers model with plain forward hooks, each prompt run alone.
"""

import pytest
import torch

from conftest import cache_tensors, encode, layers

PROMPTS = ["hello", "the capital of france is paris and", "a b c"]


def hook_outputs(module, fn, **kwargs):
    """Run `fn()` with a forward hook on `module`; the outputs it saw (and edits via kwargs)."""
    seen = []
    edit = kwargs.get("edit")

    def hook(mod, args, output):
        if edit is not None:
            output = edit(output)
        seen.append(output.clone())
        return output

    handle = module.register_forward_hook(hook)
    try:
        result = fn()
    finally:
        handle.remove()
    return seen, result


def test_trace_reads_equal_plain_hooks(lm, hf_model, hf_tokenizer, arch):
    ids = encode(hf_tokenizer, PROMPTS[1])
    with torch.no_grad():
        seen, ref = hook_outputs(layers(hf_model, arch)[0], lambda: hf_model(ids))
    with torch.no_grad():
        with lm.trace(PROMPTS[1]) as tracer:
            h0 = layers(lm, arch)[0].output.save()
            logits = tracer.result.logits.save()
    torch.testing.assert_close(h0, seen[0])
    torch.testing.assert_close(logits, ref.logits)


def test_edit_equals_plain_hook_edit(lm, hf_model, hf_tokenizer, arch):
    ids = encode(hf_tokenizer, PROMPTS[1])
    with torch.no_grad():
        _, ref = hook_outputs(layers(hf_model, arch)[0].mlp, lambda: hf_model(ids), edit=lambda o: o * 0)
        plain = hf_model(ids).logits
        with lm.trace(PROMPTS[1]):
            layers(lm, arch)[0].mlp.output[:] = 0
            logits = lm.lm_head.output.save()
    torch.testing.assert_close(logits, ref.logits)
    assert not torch.allclose(logits, plain, atol=1e-3)


@pytest.mark.parametrize("form", ["strings", "id lists", "tensor+mask", "batch encoding", "keywords"])
def test_batched_prompts_equal_each_alone(lm, hf_model, hf_tokenizer, form):
    lengths = [len(hf_tokenizer(p)["input_ids"]) for p in PROMPTS]
    padded = lm.tokenizer(PROMPTS, padding=True, return_tensors="pt")  # lm's: left, eos as pad
    inputs = {
        "strings": PROMPTS,
        "id lists": [hf_tokenizer(p)["input_ids"] for p in PROMPTS],
        "tensor+mask": padded["input_ids"],
        "batch encoding": padded,
        "keywords": None,
    }[form]
    kwargs = {"attention_mask": padded["attention_mask"]} if form in ("tensor+mask", "keywords") else {}
    if form == "keywords":
        kwargs["input_ids"] = padded["input_ids"]
    args = () if inputs is None else (inputs,)
    with torch.no_grad():
        with lm.trace(*args, **kwargs) as tracer:
            logits = tracer.result.logits.save()
        for i, n in enumerate(lengths):
            alone = hf_model(encode(hf_tokenizer, PROMPTS[i])).logits[0]
            torch.testing.assert_close(logits[i, -n:], alone)


def test_invokes_of_different_lengths(lm, hf_model, hf_tokenizer, arch):
    """Each invoke sees its own rows, left-padded to the longest invoke, equal to it alone."""
    with torch.no_grad():
        with lm.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                a = layers(lm, arch)[1].output.save()
            with tracer.invoke(PROMPTS[1:]):
                layers(lm, arch)[0].mlp.output[:] = 0  # edits only invoke 1's rows
                b = layers(lm, arch)[1].output.save()
    logits = tracer.result.logits  # after the block: the whole batch's return value
    n0 = len(hf_tokenizer(PROMPTS[0])["input_ids"])
    assert a.shape[0] == 1 and b.shape[0] == 2
    with torch.no_grad():
        seen, ref0 = hook_outputs(layers(hf_model, arch)[1], lambda: hf_model(encode(hf_tokenizer, PROMPTS[0])))
    torch.testing.assert_close(a[0, -n0:], seen[0][0])
    torch.testing.assert_close(logits[0, -n0:], ref0.logits[0])
    zero = layers(hf_model, arch)[0].mlp.register_forward_hook(lambda m, i, o: o * 0)
    try:
        with torch.no_grad():
            for row, text in zip((1, 2), PROMPTS[1:]):
                n = len(hf_tokenizer(text)["input_ids"])
                ref = hf_model(encode(hf_tokenizer, text)).logits[0]
                torch.testing.assert_close(logits[row, -n:], ref)
    finally:
        zero.remove()
    with torch.no_grad():
        plain = hf_model(encode(hf_tokenizer, PROMPTS[1])).logits[0]
    n1 = len(hf_tokenizer(PROMPTS[1])["input_ids"])
    assert not torch.allclose(logits[1, -n1:], plain, atol=1e-3)


def _outputs_of_invokes(lm, prompts):
    """`model.output` as each invoke of one trace reads it, one invoke per prompt."""
    outs = []
    with torch.no_grad():
        with lm.trace() as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    outs.append(lm.output.save())
    return outs


def test_each_invoke_reads_the_models_output_as_its_own_output_object(lm, hf_model, hf_tokenizer, arch):
    """`model.output` read in each invoke is that invoke's rows of the model's output object:
    the same type and keys as the plain model's, its logits equal to the prompt run alone
    (right-aligned: shorter prompts are left-padded), by attribute, key and position."""
    texts = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    outs = _outputs_of_invokes(lm, texts)
    for text, out in zip(texts, outs):
        with torch.no_grad():
            ref = hf_model(encode(hf_tokenizer, text))
        n = len(hf_tokenizer(text)["input_ids"])
        assert type(out) is type(ref) and list(out.keys()) == list(ref.keys())
        assert out.logits.shape[0] == 1
        assert out.logits is out["logits"] is out[0]
        torch.testing.assert_close(out.logits[0, -n:], ref.logits[0])


def test_each_invoke_reads_its_own_rows_of_the_models_cache(lm, hf_model):
    """Every value of `model.output` read in an invoke, the returned cache too (a transformers
    `Cache` object or a legacy tuple), equals the prompt run alone."""
    torch.manual_seed(0)
    rows = [torch.randint(1, 100, (1, 5)) for _ in range(3)]  # one width: no padding
    outs = _outputs_of_invokes(lm, rows)
    for row, out in zip(rows, outs):
        with torch.no_grad():
            ref = hf_model(row)
        assert list(out.keys()) == list(ref.keys())
        for key in ref.keys():
            if isinstance(ref[key], torch.Tensor):
                torch.testing.assert_close(out[key], ref[key])
                continue
            got, want = cache_tensors(out[key]), cache_tensors(ref[key])
            assert type(out[key]) is type(ref[key]) and len(got) == len(want), key
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, msg=key)


def test_invokes_of_token_id_tensors_of_any_width_and_form_equal_each_alone(lm, hf_model, hf_tokenizer):
    """Invokes given tensors of ids (1-D, 2-D, int32), of one width or several, or beside a
    string, are each the prompt alone; none of them changes the user's tensor."""
    short, long = (encode(hf_tokenizer, text)[0] for text in PROMPTS[:2])
    cases = {
        "one width": [short, short.unsqueeze(0).int(), short.flip(0)],
        "widths": [short, long.unsqueeze(0), short],
        "with text": [long, PROMPTS[2], short.unsqueeze(0)],
    }
    for name, prompts in cases.items():
        before = [p.clone() if isinstance(p, torch.Tensor) else p for p in prompts]
        for _ in range(3):  # (the third run's invokes run as generators)
            outs = []
            with torch.no_grad(), lm.trace() as tracer:
                for prompt in prompts:
                    with tracer.invoke(prompt):
                        lm.lm_head.output[:] = lm.lm_head.output * 1  # an in-place edit of each
                        outs.append(lm.lm_head.output.save())
            for prompt, out in zip(prompts, outs):
                ids = prompt if isinstance(prompt, torch.Tensor) else encode(hf_tokenizer, prompt)
                ids = ids.reshape(1, -1).long()
                with torch.no_grad():
                    alone = hf_model(ids).logits
                torch.testing.assert_close(out[:, -ids.shape[1]:], alone, msg=name)
        for prompt, kept in zip(prompts, before):
            assert not isinstance(prompt, torch.Tensor) or (torch.equal(prompt, kept) and prompt.dtype == kept.dtype)


def test_envoy_tree_and_fallthrough(lm, arch):
    assert len(layers(lm, arch)) == 2
    assert lm.config.vocab_size == len(lm.tokenizer)
    with pytest.raises(AttributeError, match="has no submodule or attribute 'nope'"):
        lm.nope
    # Outside a trace the wrapped model runs as the plain module.
    ids = encode(lm.tokenizer, "hello")
    with torch.no_grad():
        torch.testing.assert_close(lm(ids).logits, lm._module(ids).logits)


def test_unknown_keyword_is_an_error(lm):
    with pytest.raises(TypeError, match=r"forward does not take 'max_new_tokens'.*belong to model.generate\(\)"):
        with lm.trace("hello", max_new_tokens=3):
            pass
    with pytest.raises(TypeError, match=r"forward does not take 'temprature'") as info:
        with lm.trace("hello", temprature=0.5):
            lm.lm_head.output.save()
    assert isinstance(info.value, ValueError)  # UnknownKeywordError is both


def test_known_keywords_reach_the_model(lm, hf_model, hf_tokenizer):
    with torch.no_grad():
        with lm.trace("hello world", output_hidden_states=True) as tracer:
            out = tracer.result.save()
        ref = hf_model(encode(hf_tokenizer, "hello world"), output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1])


@pytest.mark.parametrize(
    "args, error, message",
    [
        (([],), ValueError, r"the list of prompts is empty"),
        ((42,), TypeError, r"cannot use a value of type int as a prompt"),
        (("a", "b"), TypeError, r"got 2 positional inputs; pass one prompt"),
        (((1.5, 2.5),), TypeError, r"cannot use a list of float values as prompts"),
    ],
)
def test_bad_inputs_raise_at_trace(lm, args, error, message):
    with pytest.raises(error, match=message):
        with lm.trace(*args):
            lm.lm_head.output.save()
    # The model is clean and usable afterwards.
    with lm.trace("hello") as tracer:
        ok = tracer.result.logits.save()
    assert ok.shape[0] == 1


def test_position_ids_given_is_refused(lm):
    with pytest.raises(TypeError, match=r"position_ids are computed from the attention mask"):
        with lm.trace("hello", position_ids=torch.tensor([[0]])):
            pass


def test_wrapped_module_without_tokenizer_takes_ids(hf_model, hf_tokenizer):
    from interlace import LanguageModel

    model = LanguageModel(hf_model)
    ids = encode(hf_tokenizer, "hello world")
    with torch.no_grad():
        with model.trace(ids) as tracer:
            logits = tracer.result.logits.save()
        torch.testing.assert_close(logits, hf_model(ids).logits)
    with pytest.raises(TypeError, match=r"string prompts need a tokenizer"):
        with model.trace("hello"):
            pass


def test_skip_a_layer_like_an_identity_hook(lm, hf_model, hf_tokenizer, arch):
    ids = encode(hf_tokenizer, PROMPTS[1])

    def identity(module, args, kwargs, output):
        return args[0] if args else kwargs["hidden_states"]

    handle = layers(hf_model, arch)[1].register_forward_hook(identity, with_kwargs=True)
    try:
        with torch.no_grad():
            ref = hf_model(ids).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = hf_model(ids).logits
        with lm.trace(PROMPTS[1]) as tracer:
            layers(lm, arch)[1].skip(layers(lm, arch)[0].output)
            logits = tracer.result.logits.save()
    torch.testing.assert_close(logits, ref)
    assert not torch.allclose(logits, plain, atol=1e-3)


def test_stop_keeps_what_was_saved(lm, arch):
    calls = []
    handle = lm._module.lm_head.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        with torch.no_grad():
            with lm.trace(PROMPTS[0]) as tracer:
                h = layers(lm, arch)[0].output.save()
                tracer.stop()
    finally:
        handle.remove()
    assert calls == []  # the model stopped before its head
    assert h.shape[:2] == (1, len(lm.tokenizer(PROMPTS[0])["input_ids"]))


def test_gradients_equal_autograd(lm, hf_model, hf_tokenizer, arch):
    ids = encode(hf_tokenizer, PROMPTS[1])
    seen = []
    handle = layers(hf_model, arch)[0].register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        loss = hf_model(ids).logits[0, -1].logsumexp(-1)
    finally:
        handle.remove()
    (ref,) = torch.autograd.grad(loss, seen[0])
    with lm.trace(PROMPTS[1]):
        h = layers(lm, arch)[0].output
        loss = lm.lm_head.output[0, -1].logsumexp(-1)
        with loss.backward():
            grad = h.grad.save()
    torch.testing.assert_close(grad, ref)
    assert grad.abs().sum() > 0


# -- trace=False and tracer_cls= (nnsight 0.8.1's keywords of trace and generate) -----------


def test_trace_false_tokenizes_and_returns_the_forwards_output(lm, hf_model, hf_tokenizer):
    ids = encode(hf_tokenizer, PROMPTS[1])
    with torch.no_grad():
        out = lm.trace(PROMPTS[1], trace=False)
        expected = hf_model(ids)
    assert torch.equal(out.logits, expected.logits)


def test_generate_trace_false_returns_what_generate_returns(lm, hf_model, hf_tokenizer):
    ids = encode(hf_tokenizer, PROMPTS[1])
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    out = lm.generate(PROMPTS[1], trace=False, **kwargs)
    # (one unpadded prompt: the pad id given only silences transformers' warning)
    expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                 pad_token_id=hf_tokenizer.eos_token_id, **kwargs)
    assert torch.equal(out, expected)


def test_tracer_cls_on_trace_and_generate(lm):
    from interlace.models.language_model import LanguageTracer

    class Mine(LanguageTracer):
        pass

    assert type(lm.trace(PROMPTS[0], tracer_cls=Mine)) is Mine
    with lm.generate(PROMPTS[0], max_new_tokens=2, tracer_cls=Mine) as tracer:
        logits = lm.lm_head.output.save()
    assert type(tracer) is Mine and logits.shape[-1] == lm.lm_head.out_features
