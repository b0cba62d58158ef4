"""What a sweep keeps: lists in item order, None where an item saved nothing, compact values."""

import gc
import tracemalloc
import weakref

import pytest
import torch

from interlace import InterlaceError

from .conftest import assert_clean


def test_lists_in_item_order_with_none_where_an_item_did_not_save(model, corrupt):
    with torch.no_grad(), model.sweep(range(5), input=corrupt, batch_size=2,
                                      progress=False) as sweep:
        k = sweep.item
        if k % 2 == 0:
            even = model.transformer.h[0].output[:, k].save()
        label = f"item {sweep.index}".save()
        scratch = k * 2.0  # assigned, never saved  # noqa: F841
    assert label == [f"item {k}" for k in range(5)]
    assert [v is None for v in even] == [False, True, False, True, False]
    assert set(sweep.results) == {"even", "label"}
    assert sweep.results["even"] is even and sweep.results.finished == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError, match="no sweep item saved 'scratch'"):
        sweep.results["scratch"]
    with pytest.raises(NameError, match="scratch"):
        scratch  # noqa: B018 - unbound after the block, as after a trace
    for k in (0, 2, 4):
        with torch.no_grad(), model.trace(corrupt):
            alone = model.transformer.h[0].output[:, k].save()
        assert torch.equal(even[k], alone)


def test_saved_views_are_compacted_to_their_rows(model, corrupt):
    with torch.no_grad(), model.sweep(range(4), input=corrupt, batch_size=4,
                                      progress=False) as sweep:
        pair = [model.transformer.h[0].output[:, 0], sweep.item].save()
        last = model.lm_head.output[:, -1].save()
        whole = sweep.output.logits.save()
    for value in last + whole + [p[0] for p in pair]:
        # owns exactly its elements: the batch's logits (4 rows x 8 positions) are not pinned
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
    assert last[0].shape == (1, 1000) and whole[0].shape == (1, 8, 1000)
    assert [p[1] for p in pair] == [0, 1, 2, 3] and isinstance(pair[0], list)
    with torch.no_grad(), model.trace(corrupt) as tracer:
        alone = model.lm_head.output[:, -1].save()
    assert torch.equal(last[2], alone)
    assert torch.equal(whole[2], tracer.result.logits)


def test_results_as_a_dataframe(model, corrupt):
    pandas = pytest.importorskip("pandas", reason="to_pandas() needs pandas")
    cells = [(layer, pos) for layer in range(2) for pos in range(3)]
    with torch.no_grad(), model.sweep(cells, input=corrupt, progress=False) as sweep:
        layer, pos = sweep.item
        model.transformer.h[layer].output[:, pos] = 0
        score = model.lm_head.output[0, -1, 5].save()
    frame = sweep.results.to_pandas(item_names=("layer", "pos"))
    assert isinstance(frame, pandas.DataFrame)
    assert list(frame.columns) == ["layer", "pos", "score"]
    assert frame["layer"].tolist() == [c[0] for c in cells]
    assert frame["score"].tolist() == [s.item() for s in score]
    assert list(sweep.results.to_pandas().columns) == ["item_0", "item_1", "score"]


def test_to_pandas_without_pandas_says_how_to_install(model, corrupt, monkeypatch):
    import sys

    with torch.no_grad(), model.sweep([0], input=corrupt, progress=False) as sweep:
        x = model.lm_head.output[0, -1, 0].save()  # noqa: F841
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(InterlaceError, match="pip install pandas"):
        sweep.results.to_pandas()


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [8, 500])  # 500: more bodies than the greenlet pool keeps
def test_ten_thousand_items_keep_only_what_the_bodies_save(mlp, mlp_model, batch_size):
    """Flat memory: no batch tensor, body frame or mediator outlives its batch."""
    x = torch.randn(1, 6, generator=torch.Generator().manual_seed(0))
    batch_outputs = []
    handle = mlp[4].register_forward_hook(lambda m, a, o: batch_outputs.append(weakref.ref(o)))
    n = 10_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with torch.no_grad(), mlp_model.sweep(range(n), input=x, batch_size=batch_size,
                                              progress=False) as sweep:
            mlp_model[2].output[:, sweep.item % 16] = 0.0
            y = mlp_model.output[:, 0].save()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        handle.remove()
    assert len(y) == n and len(batch_outputs) == n // batch_size
    assert all(ref() is None for ref in batch_outputs)  # no batch output is pinned
    assert all(v.untyped_storage().nbytes() == 4 for v in y)  # one float each
    # Python-side growth: the results (one tensor object and one item per item), not more
    assert grown / n < 1500, f"{grown / n:.0f} bytes per item"
    with torch.no_grad(), mlp_model.trace(x):
        mlp_model[2].output[:, 9999 % 16] = 0.0
        alone = mlp_model.output[:, 0].save()
    torch.testing.assert_close(y[-1], alone)
    assert_clean(mlp)
