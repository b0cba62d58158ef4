"""A sweep item's own cost: what the sweep does per item that it could do per batch or once.

Issue 20's sweep probe (tiny GPT-2, one patch per item, batches of 64) pays interlace's steps
per item; `benchmarks/probes/sweep_instructions.py` counts them. Here, what a regression would
show without callgrind: the Python calls the sweep's own code (`sweeps/`, `batching.py`, the
objects it makes) runs per item, on a sweep whose values equal one trace per item. And the
pieces that now work per batch (`InOrder.many`, a shared input batched once, a reused save
state) keep the rule: an item behaves as if it ran alone.
"""

import os
import sys

import pytest
import torch

from interlace.intervention.batching import Batcher, BatchingError
from interlace.sweeps.runner import Entry, InOrder

A, B = 5, 7
_SWEEPS = os.sep + os.path.join("interlace", "sweeps") + os.sep
_BATCHING = os.sep + os.path.join("interlace", "intervention", "batching.py")


def _patch(model, cells, corrupt, clean, batch_size):
    with torch.no_grad(), model.sweep(cells, input=corrupt, batch_size=batch_size,
                                      progress=False) as sweep:
        layer, pos = sweep.item
        model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
        logits = model.lm_head.output[:, -1]
        diff = (logits[:, A] - logits[:, B]).save()
    return diff


def _own_calls(fn):
    """(fn's result, {(file, name): calls}) of the sweep's own code (`sweeps/`,
    `batching.py`) and the objects it makes per item: a save state (`TraceState`), a
    dataclass (its generated `__init__` is in "<string>")."""
    calls = {}
    seen = set()  # frames met: a generator's resumption is not a call
    frames = []  # (held, so that an id is not reused by a later frame)

    def profile(frame, event, arg):
        if event != "call" or id(frame) in seen:
            return
        seen.add(id(frame))
        frames.append(frame)
        code = frame.f_code
        name = code.co_filename
        qualname = getattr(code, "co_qualname", code.co_name)
        if (_SWEEPS in name or name.endswith(_BATCHING) or qualname == "TraceState.__init__"
                or name == "<string>" and code.co_name == "__init__"):
            key = (os.path.basename(name), qualname)
            calls[key] = calls.get(key, 0) + 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(previous)
    return out, calls


def test_a_sweep_items_own_python_calls_are_few_and_its_values_each_items_alone(
        gpt2, model, clean_ids, corrupt):
    with torch.no_grad():
        clean = [o.clone() for o in _clean(gpt2, clean_ids)]
    cells = [(layer, pos) for layer in range(2) for pos in range(8)] * 4  # 64 items
    _patch(model, cells, corrupt, clean, 32)  # warm
    diff, calls = _own_calls(lambda: _patch(model, cells, corrupt, clean, 32))
    per_item = sum(calls.values()) / len(cells)
    # Per item: its object, its body's run (as a generator: its start and its finish),
    # `sweep.item` (and the lookup behind it): 4-5 calls (a generator's resumption, the
    # body's own or the stream of items', is not a call); plus the batches' own calls and a
    # save state per item of the first batch, spread over the items: 6.5 here (5.4 on
    # greenlets, 7.0 on the twin, which makes its save states in Python). (It was 16.5: an
    # entry and a body object, a dataclass, a save state, `split`, three calls to commit each
    # item...; then 8.4: the item's route looked up, compacting what it saved and its inputs'
    # `prepare`, each a call per item, which a shared input's batch now makes once.)
    assert per_item <= 7.5, sorted(calls.items(), key=lambda kv: -kv[1])[:30]
    for (layer, pos), value in zip(cells[:16], diff):
        with torch.no_grad(), model.trace(corrupt):
            model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
            logits = model.lm_head.output[:, -1]
            alone = (logits[:, A] - logits[:, B]).save()
        assert torch.equal(value, alone)
    assert all(torch.equal(a, b) for a, b in zip(diff[:16], diff[16:32]))


def _clean(gpt2, ids):
    seen = []
    handles = [b.register_forward_hook(lambda m, a, o: seen.append(o)) for b in gpt2.transformer.h]
    try:
        gpt2(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_a_reused_save_state_keeps_no_save_of_the_item_before(model, corrupt):
    # Each finished item's save state serves a later item, emptied: an item that saves
    # nothing has None in its slot, even when its value reuses a freed value's id.
    with torch.no_grad(), model.sweep(range(12), input=corrupt, batch_size=3,
                                      progress=False) as sweep:
        k = sweep.item
        h = model.transformer.h[0].output[:, 0].clone()
        if k % 2 == 0:
            h.save()
    assert [v is None for v in sweep.results["h"]] == [k % 2 == 1 for k in range(12)]
    with torch.no_grad(), model.trace(corrupt):
        alone = model.transformer.h[0].output[:, 0].clone().save()
    assert all(torch.equal(v, alone) for v in sweep.results["h"][::2])


def test_in_order_commits_a_batch_at_once_and_waits_for_the_items_before_it():
    committed = []

    def commit(entries, values):
        committed.append([(e.index, v) for e, v in zip(entries, values)])

    def entries(indices):
        return [Entry(i, i, (), {}, None) for i in indices]

    done = InOrder(commit)
    done.many(entries([2, 3]), ["c", "d"])  # a later batch first: it waits
    assert committed == []
    done.many(entries([0, 1]), ["a", "b"])  # the next batch, then the waiting, one by one
    assert committed == [[(0, "a")], [(1, "b")], [(2, "c")], [(3, "d")]]
    done.many(entries([4, 5]), ["e", "f"])  # next and in a row, nothing waiting: one commit
    assert committed[-1] == [(4, "e"), (5, "f")]
    done.many(entries([4, 5]), ["x", "y"])  # a retried batch: recorded once
    done.many(entries([6, 8]), ["g", "i"])  # not in a row (another key's item between)
    assert committed[5:] == [[(6, "g")]] and done.has(8) and not done.has(7)
    done(Entry(7, 7, (), {}, None), "h")
    assert committed[-2:] == [[(7, "h")], [(8, "i")]] and done.next == 9


@pytest.mark.parametrize("dim", [0, 1])
def test_a_shared_input_batches_as_concatenating_it(dim):
    x = torch.randn(2, 3, 4)
    batched = Batcher(dim)._combine([x] * 5, "positional argument 0")
    expected = torch.cat([x] * 5, dim=dim)
    assert torch.equal(batched, expected) and batched.stride() == expected.stride()
    y = x.clone()
    mixed = Batcher(dim)._combine([x, y, x], "positional argument 0")
    assert torch.equal(mixed, torch.cat([x, y, x], dim=dim))


@pytest.mark.parametrize("dim", [0, 1])
def test_invokes_of_the_very_same_inputs_batch_as_the_general_path(dim):
    # `Batcher.repeated` (a sweep's shared input: prepared once, no step per item) gives
    # what `batch` and `slices` give for the same prepared inputs n times.
    batcher = Batcher(dim)
    x = torch.randn(2, 3, 4)
    prepared = batcher.prepare((x, "mode"), {"scale": 2.0, "mask": x[:, :, :1]})
    args, kwargs, rows = batcher.repeated(prepared, 5)
    general_args, general_kwargs = batcher.batch([prepared] * 5)
    assert len(args) == 2 and args[1] == "mode" and torch.equal(args[0], general_args[0])
    assert kwargs.keys() == general_kwargs.keys() and kwargs["scale"] == 2.0
    assert torch.equal(kwargs["mask"], general_kwargs["mask"])
    assert rows == batcher.slices([prepared] * 5)
    assert rows == [slice(i * x.shape[dim], (i + 1) * x.shape[dim]) for i in range(5)]


def test_invokes_of_one_input_without_the_batch_dim_are_refused_as_before():
    scalar = torch.tensor(1.0)
    with pytest.raises(BatchingError, match="in invoke 0"):
        Batcher(0).repeated(Batcher(0).prepare((scalar,), {}), 3)


def test_a_shared_input_without_the_batch_dim_is_still_refused():
    scalar = torch.tensor(1.0)
    with pytest.raises(BatchingError, match="in invoke 0"):
        Batcher(0)._combine([scalar] * 3, "positional argument 0")


def _collect(model, windows, batch_size):
    """The activation-collection body (`benchmarks/probes/datasets.py`): two layers' rows of
    each window saved, the item's forward stopped after the last one."""
    with torch.no_grad(), model.sweep(windows, input=lambda ids: ids[None], batch_size=batch_size,
                                      progress=False) as sweep:
        first = model.transformer.h[0].output[0].save()
        last = model.transformer.h[1].output[0].save()
        sweep.stop()
    return first, last


def test_an_items_own_calls_do_not_grow_with_its_batch(model):
    # `sweep.stop()` asks whether the batch's other items are done: scanned from the start of
    # the batch, the question cost each item its position in it (33 calls per item at 64).
    # A per-item input's batch key is one call, however deep its structure.
    windows = torch.randint(0, 1000, (128, 6), generator=torch.Generator().manual_seed(0))
    per_item = {}
    for size in (8, 64):
        _collect(model, windows, size)  # warm
        (first, last), calls = _own_calls(lambda: _collect(model, windows, size))
        per_item[size] = sum(calls.values()) / len(windows)
        assert not any(name == "_value_key" for _, name in calls), calls
    assert per_item[64] <= per_item[8] + 0.5, per_item
    for k in (0, 77, 127):  # and the values are each window's alone
        with torch.no_grad(), model.trace(windows[k][None]):
            h0 = model.transformer.h[0].output[0].save()
            h1 = model.transformer.h[1].output[0].save()
        # (batched, BLAS may split the matmuls otherwise than for one window: 1e-5 apart)
        torch.testing.assert_close(first[k], h0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(last[k], h1, rtol=1e-4, atol=1e-5)


def test_entries_made_without_their_job_run_as_each_item_alone(gpt2, model, clean_ids, corrupt,
                                                                monkeypatch):
    # A Ray worker rebuilds the entries it is sent (no job, no route): `run_batch` gives them
    # the job's, and each item still equals its trace alone.
    from interlace.sweeps import runner

    made = runner.Job.entries

    def shipped(self, model_, items):
        for e in made(self, model_, items):
            yield Entry(e.index, e.item, e.args, e.kwargs, e.key)

    monkeypatch.setattr(runner.Job, "entries", shipped)
    with torch.no_grad():
        clean = [o.clone() for o in _clean(gpt2, clean_ids)]
    cells = [(layer, pos) for layer in range(2) for pos in range(4)]
    diff = _patch(model, cells, corrupt, clean, 4)
    for (layer, pos), value in zip(cells, diff):
        with torch.no_grad(), model.trace(corrupt):
            model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
            logits = model.lm_head.output[:, -1]
            alone = (logits[:, A] - logits[:, B]).save()
        assert torch.equal(value, alone)
