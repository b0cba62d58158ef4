"""`batching.narrow` and `batching.swap` on transformers `Cache` objects, built by hand with
`update` (the model's own calls), against plain slicing of the batch's tensors."""

import copy

import pytest
import torch

from interlace.errors import BatchingError
from interlace.intervention.batching import narrow, swap

cache_utils = pytest.importorskip("transformers.cache_utils")

ROWS, TOTAL = slice(1, 3), 4


def _filled(layers=2, total=TOTAL, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = cache_utils.DynamicCache()
    for i in range(layers):
        cache.update(torch.randn(total, 2, 5, 3, generator=g), torch.randn(total, 2, 5, 3, generator=g), i)
    return cache


def _tensors(cache):
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def test_an_items_copy_holds_its_rows_of_every_layer_and_is_of_the_caches_class():
    cache = _filled()
    before = [t.clone() for t in _tensors(cache)]
    out = narrow({"logits": torch.zeros(TOTAL, 2), "cache": cache}, ROWS, TOTAL)
    part = out["cache"]
    assert type(part) is type(cache) and part is not cache
    assert out["logits"].shape[0] == 2
    got = _tensors(part)
    assert len(got) == 4 and all(t.shape[0] == 2 for t in got)
    for mine, whole in zip(got, _tensors(cache)):
        assert torch.equal(mine, whole[ROWS])
        mine.add_(1)  # a view: an in-place edit reaches the batch's rows, and only those
    for whole, old in zip(_tensors(cache), before):
        assert torch.equal(whole[ROWS], old[ROWS] + 1)
        assert torch.equal(whole[:1], old[:1]) and torch.equal(whole[3:], old[3:])
    assert part.get_seq_length() == 5 and len(part) == len(cache)


def test_an_untouched_or_unchanged_copy_handed_back_is_the_batchs_own_cache():
    cache = _filled()
    for touch in (False, True):
        part = narrow(cache, ROWS, TOTAL)
        if touch:
            assert len(part.layers) == 2
        assert swap(cache, part, ROWS, TOTAL) is cache
        assert all(t.shape[0] == TOTAL for t in _tensors(cache))


def test_a_tensor_replaced_in_the_copy_is_written_into_its_rows_only():
    cache = _filled()
    before = [t.clone() for t in _tensors(cache)]
    part = narrow(cache, ROWS, TOTAL)
    part.layers[1].values = torch.full((2, 2, 5, 3), 9.0)
    assert swap(cache, part, ROWS, TOTAL) is cache
    values = cache.layers[1].values
    assert values.shape == before[3].shape
    assert torch.equal(values[ROWS], torch.full((2, 2, 5, 3), 9.0))
    assert torch.equal(values[:1], before[3][:1]) and torch.equal(values[3:], before[3][3:])
    for now, old in zip(_tensors(cache)[:3], before[:3]):
        assert torch.equal(now, old)


def test_another_cache_stands_in_for_the_whole_batch_only():
    cache, other = _filled(), _filled(seed=1)
    assert swap(cache, other, slice(0, TOTAL), TOTAL) is other
    with pytest.raises(BatchingError, match="other than the one the item read"):
        swap(cache, _filled(total=2, seed=2), ROWS, TOTAL)
    part = narrow(cache, ROWS, TOTAL)
    part.layers = list(part.layers)  # the layers' list itself replaced
    with pytest.raises(BatchingError, match="other than the one the item read"):
        swap(cache, part, ROWS, TOTAL)


def test_a_layer_listed_twice_is_copied_once_and_other_fields_are_shared():
    cache = _filled(layers=1)
    cache.layers.append(cache.layers[0])  # (a cache whose layers share one object)
    cache.notes = {"kept": 1}  # a field that is not a list, a tensor or a cache: shared
    part = narrow(cache, ROWS, TOTAL)
    assert part.layers[0] is part.layers[1] and part.layers[0] is not cache.layers[0]
    assert part.notes is cache.notes
    assert swap(cache, part, ROWS, TOTAL) is cache


def test_an_encoder_decoder_caches_two_caches_are_narrowed():
    both = cache_utils.EncoderDecoderCache(_filled(seed=3), _filled(seed=4))
    part = narrow(both, ROWS, TOTAL)
    assert type(part) is type(both)
    for mine, whole in ((part.self_attention_cache, both.self_attention_cache),
                        (part.cross_attention_cache, both.cross_attention_cache)):
        for a, b in zip(_tensors(mine), _tensors(whole)):
            assert torch.equal(a, b[ROWS])
    part.cross_attention_cache.layers[0].keys = torch.zeros(2, 2, 5, 3)
    assert swap(both, part, ROWS, TOTAL) is both
    assert torch.equal(both.cross_attention_cache.layers[0].keys[ROWS], torch.zeros(2, 2, 5, 3))


def test_a_copy_deep_copies_and_pickles_as_a_plain_cache_of_its_rows():
    import pickle

    cache = _filled()
    part = narrow(cache, ROWS, TOTAL)
    for other in (copy.deepcopy(part), pickle.loads(pickle.dumps(part))):
        assert type(other.layers) is list
        for a, b in zip(_tensors(other), _tensors(cache)):
            assert a.shape[0] == 2 and torch.equal(a, b[ROWS])


def test_lists_of_tensors_in_a_cache_are_narrowed_and_written_back():
    """Older transformers kept a cache's keys and values as lists of tensors: those are the
    item's rows too, and a tensor replaced in such a list goes into the batch's rows."""
    g = torch.Generator().manual_seed(5)
    cache = cache_utils.DynamicCache()
    cache.key_cache = [torch.randn(TOTAL, 2, 5, 3, generator=g) for _ in range(2)]
    cache.value_cache = [torch.randn(TOTAL, 2, 5, 3, generator=g) for _ in range(2)]
    cache.names = ["a", "b"]  # a list of anything else: kept as it is
    before = [t.clone() for t in cache.value_cache]
    part = narrow(cache, ROWS, TOTAL)
    for mine, whole in zip(part.key_cache, cache.key_cache):
        assert torch.equal(mine, whole[ROWS])
    assert part.names == ["a", "b"]
    part.value_cache[0] = torch.zeros(2, 2, 5, 3)
    assert swap(cache, part, ROWS, TOTAL) is cache
    assert torch.equal(cache.value_cache[0][ROWS], torch.zeros(2, 2, 5, 3))
    assert torch.equal(cache.value_cache[0][:1], before[0][:1])
    assert torch.equal(cache.value_cache[1], before[1])


def test_layers_added_after_the_read_are_the_items_rows_when_first_used():
    """A cache whose layers the model adds as it runs: read before they exist, the copy
    holds the item's rows of the layers there when it is first used."""
    cache = cache_utils.DynamicCache()  # (no config: layers are added by `update`)
    part = narrow(cache, ROWS, TOTAL)
    g = torch.Generator().manual_seed(6)
    cache.update(torch.randn(TOTAL, 2, 5, 3, generator=g), torch.randn(TOTAL, 2, 5, 3, generator=g), 0)
    assert len(part.layers) == 1
    assert torch.equal(part.layers[0].keys, cache.layers[0].keys[ROWS])


def test_an_item_that_adds_layers_to_its_copy_cannot_hand_it_back():
    cache = _filled()
    part = narrow(cache, ROWS, TOTAL)
    part.layers.append(part.layers[0])
    with pytest.raises(BatchingError, match="added or removed layers"):
        swap(cache, part, ROWS, TOTAL)


def test_a_layers_tensors_without_a_batch_axis_are_the_batchs_own():
    """A layer's tensors that do not carry the batch (a count kept as a 0-dim tensor, a
    buffer with one row) are shared as they are, the same objects as in the batch's cache."""
    cache = _filled(layers=1)
    cache.layers[0].count = torch.tensor(5)
    cache.layers[0].table = torch.randn(1, 3)
    part = narrow(cache, ROWS, TOTAL)
    layer = part.layers[0]
    assert layer.count is cache.layers[0].count and layer.table is cache.layers[0].table
    assert torch.equal(layer.keys, cache.layers[0].keys[ROWS])
    assert swap(cache, part, ROWS, TOTAL) is cache
