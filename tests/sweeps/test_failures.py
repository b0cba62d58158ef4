"""Out of memory, errors in a body or in the model, Ctrl-C, and mistakes in the call.

The rule: every item's values are recorded exactly once, in item order; after a failure the
model is clean and `sweep.results` holds exactly the items before the one that failed.
"""

import sys

import pytest
import torch

from interlace import InterlaceError

from .conftest import Calls, assert_clean


def alone(model, ids, k):
    with torch.no_grad(), model.trace(ids):
        model.transformer.h[0].output[:, k % 8] += 1.0
        out = model.lm_head.output[:, -1].save()
    return out


class Raise:
    """A forward hook on `module` that raises `make()` when `when(rows, call)` is true."""

    def __init__(self, module, when, make):
        self.module, self.when, self.make, self.calls = module, when, make, []

    def __enter__(self):
        def hook(module, args, output):
            self.calls.append(output.shape[0])
            if self.when(output.shape[0], len(self.calls)):
                raise self.make()

        self.handle = self.module.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_out_of_memory_splits_the_batch_and_records_each_item_once(gpt2, model, corrupt):
    runs = []
    oom = Raise(gpt2.transformer.h[1], lambda rows, call: rows > 2,
                lambda: torch.OutOfMemoryError("CUDA out of memory (simulated by a test hook)"))
    with oom, torch.no_grad(), model.sweep(range(7), input=corrupt, batch_size=7,
                                           progress=False) as sweep:
        k = sweep.item
        runs.append(k)  # a side effect: repeated when a batch is retried
        model.transformer.h[0].output[:, k % 8] += 1.0
        out = model.lm_head.output[:, -1].save()
    assert oom.calls == [7, 3, 1, 2, 4, 2, 2]  # 7 rows failed, then halves of halves
    assert sweep.chosen_batch_size <= 2
    assert len(out) == 7 and sweep.results.finished == list(range(7))
    for k in range(7):
        assert torch.equal(out[k], alone(model, corrupt, k))
    assert len(runs) > 7 and set(runs) == set(range(7))  # bodies re-ran, values recorded once
    assert_clean(gpt2)


def test_out_of_memory_on_a_single_item_is_raised_naming_it(gpt2, model, corrupt):
    oom = Raise(gpt2.transformer.h[1], lambda rows, call: call >= 3,
                lambda: torch.OutOfMemoryError("CUDA out of memory (simulated)"))
    with oom, pytest.raises(torch.OutOfMemoryError) as info:
        with torch.no_grad(), model.sweep(range(5), input=corrupt, batch_size=1,
                                          progress=False) as sweep:
            out = model.lm_head.output[:, -1].save()  # noqa: F841
    assert any("sweep item 2" in note for note in info.value.__notes__)
    assert sweep.results.finished == [0, 1]
    assert_clean(gpt2)


def test_error_in_a_body_names_the_item_and_line_and_keeps_the_items_before(gpt2, model, corrupt):
    with pytest.raises(ZeroDivisionError) as info:
        with torch.no_grad(), model.sweep(range(10), input=corrupt, batch_size=4,
                                          progress=False) as sweep:
            k = sweep.item
            model.transformer.h[0].output[:, k % 8] += 1.0
            out = model.lm_head.output[:, -1].save()
            if k == 6:
                1 / 0
    line = info.traceback[-1].lineno + 1  # the `1 / 0` line (0-based in pytest)
    notes = "\n".join(info.value.__notes__)
    assert "sweep item 6 (6)" in notes and f"test_failures.py:{line}" in notes
    assert info.traceback[-1].path.name == "test_failures.py"  # the user's frame, not ours
    assert sweep.results.finished == [0, 1, 2, 3, 4, 5]
    values = sweep.results["out"]
    for k in range(6):
        assert torch.equal(values[k], alone(model, corrupt, k))
    assert_clean(gpt2)
    with torch.no_grad(), model.sweep([1], input=corrupt, progress=False) as sweep:
        out = model.lm_head.output[:, -1].save()
    assert len(out) == 1  # the model works on


def test_the_first_failing_item_wins_whatever_order_the_batch_failed_in(gpt2, model, corrupt):
    """Item 6 fails at block 0, item 5 later at block 1: alone, item 5 fails first."""
    with pytest.raises(ValueError, match="item five") as info:
        with torch.no_grad(), model.sweep(range(8), input=corrupt, batch_size=8,
                                          progress=False) as sweep:
            k = sweep.item
            h0 = model.transformer.h[0].output
            if k == 6:
                raise ValueError("item six")
            h1 = model.transformer.h[1].output
            if k == 5:
                raise ValueError("item five")
            out = (h0 + h1)[:, -1, :3].save()  # noqa: F841
    assert any("sweep item 5" in note for note in info.value.__notes__)
    assert sweep.results.finished == [0, 1, 2, 3, 4]
    assert_clean(gpt2)


def test_error_raised_by_the_model_is_traced_to_its_item(gpt2, model, corrupt):
    """The model (a hook here) rejects item 3's edit: the batch is bisected to name it."""
    sentinel = 1234.5

    def rejects(module, args):
        if (args[0] == sentinel).any():
            raise RuntimeError("the model rejects this activation")

    handle = gpt2.transformer.h[1].register_forward_pre_hook(rejects)
    try:
        with pytest.raises(RuntimeError, match="rejects") as info:
            with torch.no_grad(), model.sweep(range(6), input=corrupt, batch_size=6,
                                              progress=False) as sweep:
                k = sweep.item
                if k == 3:
                    model.transformer.h[0].output[:, 0, 0] = sentinel
                out = model.lm_head.output[:, -1].save()  # noqa: F841
    finally:
        handle.remove()
    assert any("sweep item 3" in note for note in info.value.__notes__)
    assert sweep.results.finished == [0, 1, 2]
    assert_clean(gpt2)


def test_error_in_the_input_callable_names_the_item(mlp, mlp_model):
    x = torch.ones(1, 6)

    def make(item):
        if item == 4:
            raise KeyError("no input for 4")
        return x * item

    with pytest.raises(KeyError) as info:
        with torch.no_grad(), mlp_model.sweep(range(9), input=make, batch_size=3,
                                              progress=False) as sweep:
            y = mlp_model.output.save()  # noqa: F841
    assert any("sweep item 4" in note for note in info.value.__notes__)
    assert sweep.results.finished == [0, 1, 2, 3]
    assert_clean(mlp)


def test_ctrl_c_leaves_the_model_clean_and_keeps_finished_items(gpt2, model, corrupt):
    interrupt = Raise(gpt2.transformer.h[1], lambda rows, call: call == 3, KeyboardInterrupt)
    with interrupt, pytest.raises(KeyboardInterrupt):
        with torch.no_grad(), model.sweep(range(20), input=corrupt, batch_size=4,
                                          progress=False) as sweep:
            k = sweep.item
            model.transformer.h[0].output[:, k % 8] += 1.0
            out = model.lm_head.output[:, -1].save()
    assert sweep.results.finished == list(range(8))  # two batches finished
    for k in range(8):
        assert torch.equal(sweep.results["out"][k], alone(model, corrupt, k))
    assert_clean(gpt2)
    with Calls(gpt2) as calls, torch.no_grad(), model.sweep(range(3), input=corrupt,
                                                           progress=False) as sweep:
        out = model.lm_head.output[:, -1].save()
    assert len(out) == 3 and calls.sizes == [3]


def test_progress_bar(model, corrupt, capsys):
    pytest.importorskip("tqdm")
    with torch.no_grad(), model.sweep(range(6), input=corrupt, batch_size=4) as sweep:
        out = model.lm_head.output[:, -1].save()  # noqa: F841
    err = capsys.readouterr().err
    assert "6/6" in err and "item/s" in err and "sweep" in err
    with torch.no_grad(), model.sweep(range(6), input=corrupt, progress=False) as sweep:
        out = model.lm_head.output[:, -1].save()  # noqa: F841
    assert capsys.readouterr().err == ""


def test_item_and_output_outside_the_body(model, corrupt):
    with torch.no_grad(), model.sweep([0], input=corrupt, progress=False) as sweep:
        out = model.lm_head.output[:, -1].save()  # noqa: F841
    with pytest.raises(InterlaceError, match="sweep.item is only available inside the body"):
        sweep.item  # noqa: B018
    with pytest.raises(InterlaceError, match="sweep.output is only available inside"):
        sweep.output  # noqa: B018


def test_item_in_another_trace_and_output_in_a_nested_trace(model, mlp_model, corrupt):
    """`sweep.item` works in a trace of another model nested in the body (test_local.py);
    `sweep.output` there cannot (the item's forward waits for that trace), and a later trace
    of the model is not the sweep's body: each error says where to read it instead."""
    with pytest.raises(InterlaceError, match=r"sweep.output was read in the body of a trace "
                                             r"of another model.*read it in the outer body"):
        with torch.no_grad(), model.sweep([0], input=corrupt, progress=False) as sweep:
            with mlp_model.trace(torch.zeros(1, 6)):
                out = sweep.output.save()  # noqa: F841
    with pytest.raises(InterlaceError, match=r"sweep.item was read in the body of a trace that "
                                             r"is not this sweep's"):
        with torch.no_grad(), model.trace(corrupt):
            item = sweep.item  # noqa: F841


@pytest.mark.parametrize("call, message", [
    (lambda m, x: m.sweep("abc", input=x), "to sweep one prompt, pass \\[prompt\\]"),
    (lambda m, x: m.sweep(5, input=x), "takes an iterable of items"),
    (lambda m, x: m.sweep([1], input=x, executor="dask"), "executor='dask' is not an executor"),
    (lambda m, x: m.sweep([1], input=x, batch_size=0), "batch_size must be a positive int"),
    (lambda m, x: m.sweep([1], input=x, workers=0), "workers must be a positive int"),
    (lambda m, x: m.sweep([1], input=x, generate=True), "wrap the model with interlace.LanguageModel"),
])
def test_mistakes_in_the_call_are_refused_before_anything_runs(model, corrupt, call, message):
    with pytest.raises(InterlaceError, match=message):
        call(model, corrupt)


def test_ray_executor_without_ray_says_how_to_install(model, corrupt, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'interlace\[ray\]'"):
        model.sweep([1], input=corrupt, executor="ray")
