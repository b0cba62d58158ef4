"""`model.sweep(...)` on the local executor: every item equals the same body run alone.

References: one `model.trace` per item running the same body (the per-item run a sweep
must be indistinguishable from), and plain torch forward hooks doing the same edits.
Equality is bitwise (float32 on CPU) where the batched kernels compute a row as they do
alone -- on this CPU, sequences of 8 tokens -- and otherwise to float32 rounding
(`same`): a matmul over more rows may block its reduction differently (plain torch shows the
same ~1e-7 differences between a batch and one row). Shapes are always equal.
"""

import pytest
import torch

from .conftest import Calls, assert_clean

A, B = 5, 7  # two token ids whose logit difference the patching sweep reads


def same(a, b):
    """Equal shapes and values to float32 rounding (see the module docstring)."""
    assert a.shape == b.shape
    torch.testing.assert_close(a, b)


def clean_outputs(gpt2, ids):
    """Each block's output on `ids`, by plain hooks."""
    seen = {}
    handles = [
        block.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o.detach().clone()))
        for i, block in enumerate(gpt2.transformer.h)
    ]
    try:
        with torch.no_grad():
            gpt2(ids)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(handles))]


def patched_by_hooks(gpt2, ids, layer, pos, clean):
    def hook(module, args, out):
        out = out.clone()
        out[:, pos] = clean[layer][:, pos]
        return out

    handle = gpt2.transformer.h[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = gpt2(ids).logits[:, -1]
    finally:
        handle.remove()
    return logits[:, A] - logits[:, B]


@pytest.mark.parametrize("batch_size", [None, 1, 5, 16])
def test_patching_sweep_equals_one_trace_per_cell_and_plain_hooks(
        gpt2, model, clean_ids, corrupt, batch_size):
    clean = clean_outputs(gpt2, clean_ids)
    cells = [(layer, pos) for layer in range(2) for pos in range(8)]
    with Calls(gpt2) as calls:
        with torch.no_grad(), model.sweep(cells, input=corrupt, batch_size=batch_size,
                                          progress=False) as sweep:
            layer, pos = sweep.item
            model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
            logits = model.lm_head.output[:, -1]
            diff = (logits[:, A] - logits[:, B]).save()
    assert isinstance(diff, list) and len(diff) == len(cells)
    assert sweep.results["diff"] is diff
    expected_batches = -(-len(cells) // (batch_size or sweep.chosen_batch_size))
    assert len(calls.sizes) == expected_batches and sum(calls.sizes) == len(cells)

    for (layer, pos), value in zip(cells, diff):
        with torch.no_grad(), model.trace(corrupt):
            model.transformer.h[layer].output[:, pos] = clean[layer][:, pos]
            logits = model.lm_head.output[:, -1]
            alone = (logits[:, A] - logits[:, B]).save()
        assert torch.equal(value, alone)
        assert torch.equal(value, patched_by_hooks(gpt2, corrupt, layer, pos, clean))
    with torch.no_grad():
        plain = gpt2(corrupt).logits[:, -1]
    assert not all(torch.equal(v, plain[:, A] - plain[:, B]) for v in diff)  # the edits bite
    assert_clean(gpt2)


def test_loops_and_nested_loops_in_the_body(gpt2, model, corrupt):
    with torch.no_grad(), model.sweep(range(4), input=corrupt, batch_size=3,
                                      progress=False) as sweep:
        k = sweep.item
        rows = []
        for layer in range(2):
            for pos in range(k, 8, 3):
                model.transformer.h[layer].output[:, pos] *= 0.5
            rows.append(model.transformer.h[layer].output[:, k].clone())
        rows = torch.stack(rows).save()
        last = model.lm_head.output[:, -1].save()
    assert len(rows) == len(last) == 4
    for k in range(4):
        with torch.no_grad(), model.trace(corrupt):
            alone_rows = []
            for layer in range(2):
                for pos in range(k, 8, 3):
                    model.transformer.h[layer].output[:, pos] *= 0.5
                alone_rows.append(model.transformer.h[layer].output[:, k].clone())
            alone_rows = torch.stack(alone_rows).save()
            alone_last = model.lm_head.output[:, -1].save()
        assert torch.equal(rows[k], alone_rows)
        assert torch.equal(last[k], alone_last)
    assert not torch.equal(last[0], last[1])


def test_sweep_in_a_loop_and_in_a_function(model, corrupt):
    def run(scale):
        with torch.no_grad(), model.sweep([0, 3], input=corrupt, progress=False) as sweep:
            model.transformer.h[0].output[:, sweep.item] *= scale
            out = model.lm_head.output[:, -1, :4].save()
        return out

    firsts = [run(scale) for scale in (0.0, 2.0)]
    for scale, out in zip((0.0, 2.0), firsts):
        for k, value in zip([0, 3], out):
            with torch.no_grad(), model.trace(corrupt):
                model.transformer.h[0].output[:, k] *= scale
                alone = model.lm_head.output[:, -1, :4].save()
            assert torch.equal(value, alone)
    assert not torch.equal(firsts[0][0], firsts[1][0])


PROMPTS = [
    "hello", "the capital of france is paris and", "a b c", "hello world",
    "the quick brown fox", "once upon a time", "rome", "the lazy dog jumps",
]


def steer(lm):
    """The steering edit the dataset sweeps apply: add a fixed vector to block 0's output."""
    return torch.linspace(-1, 1, 64)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_dataset_sweep_of_mixed_lengths_equals_each_prompt_alone(lm, tokenizer, batch_size):
    vector = steer(lm)
    with Calls(lm._module) as calls:
        with torch.no_grad(), lm.sweep(PROMPTS, batch_size=batch_size, progress=False) as sweep:
            lm.transformer.h[0].output[:] += vector
            first = lm.transformer.h[1].output[:, 0].save()  # counted from the left
            h = lm.transformer.h[1].output.save()
            logits = lm.lm_head.output[:, -1].save()
            out = sweep.output.logits.save()
    assert sum(calls.sizes) == len(PROMPTS) and len(calls.sizes) < len(PROMPTS)  # batched
    for i, prompt in enumerate(PROMPTS):
        n = len(tokenizer(prompt)["input_ids"])
        with torch.no_grad(), lm.trace(prompt) as tracer:
            lm.transformer.h[0].output[:] += vector
            alone_first = lm.transformer.h[1].output[:, 0].save()
            alone_h = lm.transformer.h[1].output.save()
            alone_logits = lm.lm_head.output[:, -1].save()
            alone_out = tracer.result.logits.save()
        assert h[i].shape == (1, n, 64)  # no padding from the other prompts
        same(first[i], alone_first)
        same(h[i], alone_h)
        same(logits[i], alone_logits)
        same(out[i], alone_out)
        with torch.no_grad():
            plain = lm._module(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[:, -1]
        assert not torch.equal(logits[i], plain)  # the steering edit bites


def test_callable_input_and_multi_prompt_items(lm):
    items = [(0, 2), (1, 3), (2, 5), (4, 6)]  # each item: two prompts of different lengths
    with torch.no_grad(), lm.sweep(items, input=lambda pair: [PROMPTS[j] for j in pair],
                                   batch_size=4, progress=False) as sweep:
        a, b = sweep.item
        lm.transformer.h[1].mlp.output[1:] = 0  # the item's second prompt only
        logits = lm.lm_head.output.save()
    for (a, b), value in zip(items, logits):
        with torch.no_grad(), lm.trace([PROMPTS[a], PROMPTS[b]]):
            lm.transformer.h[1].mlp.output[1:] = 0
            alone = lm.lm_head.output.save()
        same(value, alone)


def test_shared_input_callable_called_once_per_item(mlp, mlp_model):
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    seen = []

    def make(item):
        seen.append(item)
        return x * item

    with torch.no_grad(), mlp_model.sweep(range(5), input=make, batch_size=2,
                                          progress=False) as sweep:
        y = mlp_model.output.save()
    assert seen == list(range(5))
    for k in range(5):
        same(y[k], mlp(x * k).detach())


def test_items_from_a_generator(mlp, mlp_model):
    x = torch.randn(1, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), mlp_model.sweep((k for k in range(7)), input=x, batch_size=3,
                                          progress=False) as sweep:
        mlp_model[2].output[:, sweep.item] = 1.0
        y = mlp_model.output.save()
    assert len(y) == 7 and sweep.results.finished == list(range(7))
    for k in range(7):
        with torch.no_grad(), mlp_model.trace(x):
            mlp_model[2].output[:, k] = 1.0
            alone = mlp_model.output.save()
        same(y[k], alone)


def test_dataset_of_tensors_with_different_shapes(mlp, mlp_model):
    g = torch.Generator().manual_seed(3)
    items = [torch.randn(n, 6, generator=g) for n in (1, 3, 1, 2, 3)]
    with torch.no_grad(), mlp_model.sweep(items, batch_size=4, progress=False) as sweep:
        h = mlp_model[1].output.save()
    for x, value in zip(items, h):
        same(value, torch.relu(mlp[0](x)))


def test_skip_per_item(gpt2, model, corrupt):
    with torch.no_grad(), model.sweep([0, 1, 2], input=corrupt, batch_size=3,
                                      progress=False) as sweep:
        if sweep.item == 1:
            model.transformer.h[1].skip(model.transformer.h[0].output)
        out = model.lm_head.output[:, -1].save()
    for k in range(3):
        with torch.no_grad(), model.trace(corrupt):
            if k == 1:
                model.transformer.h[1].skip(model.transformer.h[0].output)
            alone = model.lm_head.output[:, -1].save()
        assert torch.equal(out[k], alone)
    assert not torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
    assert_clean(gpt2)


def test_gradients_per_item(gpt2, model, corrupt):
    """A body with `with loss.backward():` runs one item per forward pass."""
    with Calls(gpt2) as calls, model.sweep([3, 5, 7], input=corrupt, progress=False) as sweep:
        h = model.transformer.h[0].output
        loss = model.lm_head.output[:, -1, sweep.item].sum()
        with loss.backward():
            grad = h.grad.save()
    for token, value in zip([3, 5, 7], grad):
        with model.trace(corrupt):
            h = model.transformer.h[0].output
            loss = model.lm_head.output[:, -1, token].sum()
            with loss.backward():
                alone = h.grad.save()
        assert value.shape == alone.shape == (1, 8, 64)
        torch.testing.assert_close(value, alone)
    assert not torch.allclose(grad[0], grad[1])
    assert calls.sizes == [1, 1, 1]  # each item's backward pass needs the graph to itself
    assert sweep.chosen_batch_size == 1
    assert_clean(gpt2)


def test_each_item_starts_from_the_callers_variables(model, corrupt):
    """What one item's body assigns is never seen by another item (as in separate traces)."""
    count = 0
    seen = []
    with torch.no_grad(), model.sweep(range(5), input=corrupt, batch_size=2,
                                      progress=False) as sweep:
        count += 1
        total = float(count).save()
        if sweep.item == 1:
            only_one = 7.5
        try:
            marker = float(only_one).save()
        except NameError:
            marker = None
        seen.append(marker)  # a side effect on the caller's list: each item appends once
        h = model.transformer.h[0].output[:, 0, :2].save()
    assert total == [1.0] * 5 and count == 0
    assert seen == [None, 7.5, None, None, None]
    assert marker == [None, 7.5, None, None, None]
    assert len(h) == 5


def test_sweep_item_and_index_inside_a_trace_of_another_model_in_the_body(
        gpt2, model, mlp, mlp_model, corrupt):
    """A trace of another model nested in the sweep body runs inside the item's body, so
    `sweep.item` and `sweep.index` there are that item's; its values flow on into the item's
    own edits. Reference: plain torch, item by item."""
    items = [3, 1, 2, 0, 3]
    x = torch.randn(1, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), model.sweep(items, input=corrupt, batch_size=2,
                                      progress=False) as sweep:
        with mlp_model.trace(x):
            mlp_model[2].output[:, sweep.item] = float(sweep.index)
            seen = [sweep.item, sweep.index].save()
            y = mlp_model.output.save()
        model.transformer.h[0].output[:, 0, :4] += y[0]
        inner = y.save()
        pair = seen.save()
        logits = model.lm_head.output[:, -1].save()
    assert pair == [[item, index] for index, item in enumerate(items)]
    for index, item in enumerate(items):
        with torch.no_grad():
            h = mlp[:3](x)
            h[:, item] = float(index)
            expected = mlp[3:](h)
            same(inner[index], expected)

            def add(module, args, out, y=expected):
                out = out.clone()
                out[:, 0, :4] += y[0]
                return out

            handle = gpt2.transformer.h[0].register_forward_hook(add)
            try:
                same(logits[index], gpt2(corrupt).logits[:, -1])
            finally:
                handle.remove()
    assert_clean(gpt2)
