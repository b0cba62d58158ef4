"""A transformers `Cache` object (the model's key/value cache) seen by one invoke or sweep item
of a batch is that item's rows of it; handing it back keeps the model's own cache.

References: the plain model run on each prompt alone (its returned cache), and transformers'
own `generate` on the same weights.
"""

import pytest
import torch

from conftest import cache_tensors, encode, layers

import interlace

GREEDY = {"do_sample": False}


def _the_cache(args, kwargs):
    """The cache a decoder layer was called with (GPT-2's blocks take it positionally)."""
    from transformers.cache_utils import Cache

    found = [v for v in (*args, *kwargs.values()) if isinstance(v, Cache)]
    assert len(found) == 1
    return found[0]


def _rows(n, width=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 100, (1, width), generator=g) for _ in range(n)]


def test_an_invoke_reads_the_batch_cache_in_model_inputs_as_its_rows(lm, arch):
    """The cache a decoder layer is called with (a keyword input) is narrowed too: at a later
    generation step, each invoke's copy holds its own row of every initialised layer, and the
    batch's cache object is untouched."""
    seen = []
    with torch.no_grad(), lm.generate(max_new_tokens=3, **GREEDY) as tracer:
        for prompt in _rows(2):
            with tracer.invoke(prompt):
                for _ in tracer.iter[1]:
                    args, kwargs = layers(lm, arch)[1].inputs
                    seen.append(interlace.save(_the_cache(args, kwargs)))
    assert len(seen) == 2
    for cache in seen:
        keys = [t for t in cache_tensors(cache) if t is not None]
        assert keys and all(t.shape[0] == 1 for t in keys)


def test_inputs_handed_back_keep_the_models_cache_and_generation_matches(lm, hf_model, arch):
    """Each invoke reads a decoder layer's inputs (the cache among them, narrowed) and assigns
    them back at every step. If the model were given the copy instead of its own cache, the
    layer's update would go to the copy and later steps would lose it: the tokens must be
    transformers' own generation of each prompt alone."""
    n = 4
    prompts = _rows(2, seed=1)
    with torch.no_grad(), lm.generate(max_new_tokens=n, **GREEDY) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                for _ in tracer.iter[:n]:
                    block = layers(lm, arch)[0]
                    block.inputs = block.inputs
    ids = tracer.result
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            alone = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=n, pad_token_id=0, **GREEDY)
        assert ids[i].tolist() == alone[0].tolist()


def test_a_tensor_replaced_in_an_invokes_cache_copy_reaches_its_rows_only(lm, hf_model):
    """An invoke that replaces a layer's keys in its copy and assigns `model.output` back:
    the batch's cache (the trace's result) has those rows replaced and every other row as
    the plain model computes it."""
    prompts = _rows(3, seed=2)
    with torch.no_grad(), lm.trace() as tracer:
        for i, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                if i == 1:
                    out = lm.output
                    layer = out.cache.layers[0]
                    layer.keys = torch.full_like(layer.keys, 7.0)
                    lm.output = out
    keys = tracer.result.cache.layers[0].keys
    assert keys.shape[0] == 3
    assert torch.equal(keys[1], torch.full_like(keys[1], 7.0))
    for i in (0, 2):
        with torch.no_grad():
            alone = hf_model(prompts[i]).cache.layers[0].keys
        torch.testing.assert_close(keys[i:i + 1], alone)


def test_assigning_a_cache_of_its_own_as_an_invokes_rows_is_refused(lm, hf_model):
    other = _rows(1, seed=3)[0]
    with torch.no_grad():
        foreign = hf_model(other).cache
    with pytest.raises(interlace.BatchingError, match="cannot assign a DynamicCache other than the one the item read"):
        with torch.no_grad(), lm.trace() as tracer:
            for prompt in _rows(2, seed=4):
                with tracer.invoke(prompt):
                    out = lm.output
                    out["cache"] = foreign
                    lm.output = out


def test_a_single_trace_serves_the_models_own_cache(lm, hf_tokenizer):
    """One prompt, no batch: `model.output.cache` is the model's own object, not a copy."""
    with torch.no_grad(), lm.trace(encode(hf_tokenizer, "hello world")) as tracer:
        out = lm.output.save()
        result = tracer.result.save()
    assert out.cache is result.cache


def test_each_invokes_generate_result_holds_its_own_cache_rows(lm, hf_model):
    """`tracer.result` read in an invoke of a generation that returns a dict (the sequences,
    the scores, the cache): every part is that prompt's, generated alone."""
    n = 3
    prompts = _rows(2, seed=5)
    got = []
    with torch.no_grad(), lm.generate(max_new_tokens=n, return_dict_in_generate=True,
                                      output_scores=True, **GREEDY) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                got.append(tracer.result.save())
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            alone = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=n, pad_token_id=0,
                                      return_dict_in_generate=True, output_scores=True, **GREEDY)
        assert out.sequences.tolist() == alone.sequences.tolist()
        for a, b in zip(out.scores, alone.scores):
            torch.testing.assert_close(a, b)
        cache, want = out.past_key_values, alone.past_key_values
        assert type(cache) is type(want)
        for a, b in zip(cache_tensors(cache), cache_tensors(want)):
            torch.testing.assert_close(a, b)


def test_an_invokes_cache_is_of_the_models_class_and_works_as_one(lm, hf_model):
    """The item's cache is of the model's cache class, its methods answer for its rows, and
    it survives a deep copy and a pickle round trip with the same tensors."""
    import copy
    import pickle

    prompts = _rows(2, width=6, seed=6)
    outs = []
    with torch.no_grad(), lm.trace() as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                outs.append(lm.output.save())
    with torch.no_grad():
        want = cache_tensors(hf_model(prompts[1]).cache)
    cache = outs[1].cache
    assert type(cache) is type(hf_model(prompts[1]).cache)
    assert cache.get_seq_length() == 6 and len(cache.layers) == 2
    assert [type(layer) for layer in cache.layers] == [type(layer) for layer in
                                                       hf_model(prompts[1]).cache.layers]
    for other in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        got = cache_tensors(other)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
