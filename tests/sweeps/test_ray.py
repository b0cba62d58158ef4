"""`executor="ray"`: the same sweep on Ray actors equals the local executor, item for item.

The session's local Ray cluster on the CPU (`num_cpus=2`, conftest.py); skipped when ray is
not installed (it is an optional extra: `pip install 'interlace[ray]'`; `make test` installs it).
"""

import dataclasses

import pytest
import torch

ray = pytest.importorskip("ray", reason="executor='ray' needs ray: pip install 'interlace[ray]'")

pytestmark = pytest.mark.slow

A, B = 5, 7


def logit_gap(logits):
    """A helper defined in this test file: workers cannot import it, it travels by value."""
    return logits[:, A] - logits[:, B]


@dataclasses.dataclass(frozen=True)
class Cell:
    """A class defined in this test file, used as the sweep's items."""

    layer: int
    pos: int


def test_patching_sweep_on_ray_equals_the_local_executor(ray_cluster, gpt2, model, clean_ids,
                                                         corrupt):
    with torch.no_grad(), model.trace(clean_ids):
        clean = [model.transformer.h[i].output for i in range(2)].save()
    cells = [Cell(layer, pos) for layer in range(2) for pos in range(8)]
    runs = {}
    for executor in ("local", "ray"):
        with torch.no_grad(), model.sweep(cells, input=corrupt, batch_size=3, executor=executor,
                                          workers=2, progress=False) as sweep:
            cell = sweep.item
            model.transformer.h[cell.layer].output[:, cell.pos] = clean[cell.layer][:, cell.pos]
            gap = logit_gap(model.lm_head.output[:, -1]).save()
        runs[executor] = (gap, sweep.results.finished)
    (local, local_items), (remote, remote_items) = runs["local"], runs["ray"]
    assert remote_items == local_items == cells
    assert len(remote) == len(cells)
    for a, b in zip(local, remote):
        assert torch.equal(a, b)
    assert not all(torch.equal(remote[0], r) for r in remote)


def test_an_error_on_a_worker_names_the_item_and_keeps_the_items_before(ray_cluster, model,
                                                                        corrupt):
    with pytest.raises(ZeroDivisionError) as info:
        with torch.no_grad(), model.sweep(range(12), input=corrupt, batch_size=2, executor="ray",
                                          workers=2, progress=False) as sweep:
            k = sweep.item
            out = model.lm_head.output[:, -1, :3].save()
            if k == 7:
                1 / 0
    assert any("sweep item 7" in note and "test_ray.py" in note for note in info.value.__notes__)
    assert sweep.results.finished == list(range(7))
    with torch.no_grad(), model.trace(corrupt):
        alone = model.lm_head.output[:, -1, :3].save()
    assert all(torch.equal(v, alone) for v in sweep.results["out"])


def test_language_model_loaded_from_a_folder_is_rebuilt_on_workers(ray_cluster, lm, tmp_path):
    import interlace

    lm._module.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    loaded = interlace.LanguageModel(str(tmp_path))
    prompts = ["hello world", "the capital of", "a b c", "rome", "the quick brown fox"]
    vector = torch.linspace(-1, 1, 64)
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs (Ray gives an actor one CPU): bitwise equal
    try:
        for executor in ("local", "ray"):
            with torch.no_grad(), loaded.sweep(prompts, executor=executor, workers=2,
                                               progress=False) as sweep:
                loaded.transformer.h[0].output[:] += vector
                logits = loaded.lm_head.output[:, -1].save()
            out[executor] = logits
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(out["local"], out["ray"]):
        assert a.shape == b.shape and torch.equal(a, b)
        assert not a.requires_grad and not b.requires_grad  # the caller's no_grad, on workers too


class TwoArgs(torch.nn.Module):
    """A forward of two positional arguments (defined here: it travels by value)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 8)
        self.gate = torch.nn.Linear(3, 8)

    def forward(self, x, y, scale=1.0):
        return self.proj(x) * torch.sigmoid(self.gate(y)) * scale


def test_inputs_cache_and_stop_on_ray_equal_the_local_executor(ray_cluster):
    import interlace

    model = interlace.Model(TwoArgs().eval())
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(2, 6, generator=gen), torch.randn(2, 3, generator=gen)
    runs = {}
    for executor in ("local", "ray"):
        for shared in (interlace.Inputs(x, y, scale=2.0), lambda i: interlace.Inputs(x + i, y)):
            with torch.no_grad(), model.sweep(range(4), input=shared, batch_size=2,
                                              executor=executor, workers=2,
                                              progress=False) as sweep:
                cache = sweep.cache()
                model.proj.output[:] *= sweep.item
                if sweep.item == 2:
                    sweep.stop()
                out = sweep.output.save()
            runs.setdefault(executor, []).append((cache, out))
    for (local_cache, local_out), (remote_cache, remote_out) in zip(runs["local"], runs["ray"]):
        assert remote_out[2] is None and local_out[2] is None
        for a, b in zip(local_out, remote_out):
            assert (a is None and b is None) or torch.equal(a, b)
        for a, b in zip(local_cache, remote_cache):
            assert list(a) == list(b)
            for path in a:
                assert torch.equal(a[path].output, b[path].output)
    with torch.no_grad(), model.trace(x, y, scale=2.0) as tracer:  # item 2 alone
        alone = tracer.cache()
        model.proj.output[:] *= 2
        tracer.stop()
    assert list(runs["ray"][0][0][2]) == list(alone)
