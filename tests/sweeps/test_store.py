"""`model.sweep(..., save_to=path)`: saved values streamed to a `datasets` folder, resumed after
a crash, refused when the sweep changed (sweeps/store.py, docs/sweeps.md).

References: one trace per item, an uninterrupted run, `datasets.load_from_disk`.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import interlace

datasets = pytest.importorskip(
    "datasets", reason="save_to= needs datasets: pip install 'interlace[datasets]'")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
sys.path.insert(0, HERE)
import store_job  # noqa: E402


def alone(model, ids):
    """One trace per item: the reference."""
    hidden, logits = [], []
    for i in range(len(ids)):
        with torch.no_grad(), model.trace(ids[i:i + 1]):
            hidden.append(model.transformer.h[0].output.save())
            logits.append(model.lm_head.output[:, -1].save())
    return hidden, logits


def run_job(folder, log, kill_at):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               STORE_JOB_LOG=str(log))
    env["STORE_JOB_KILL_AT"] = str(kill_at)
    return subprocess.run([sys.executable, os.path.join(HERE, "store_job.py"), str(folder)],
                          env=env, capture_output=True, text=True, timeout=120)


def ran(log):
    with open(log) as f:
        return [int(line) for line in f]


@pytest.mark.slow
def test_a_sweep_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    folder, log = tmp_path / "acts", tmp_path / "log"
    killed = run_job(folder, log, kill_at=13)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first = ran(log)
    assert max(first) == 13  # batches of 4: items 0-11 finished, 12-15 were in flight
    model, _, ids = store_job.build()  # the same seeded model and items, in this process
    monkeypatch.setenv("STORE_JOB_LOG", str(tmp_path / "resumed"))
    store_job.sweep(model, ids, folder)
    assert ran(tmp_path / "resumed") == list(range(12, store_job.N_ITEMS))  # 0-11 did not rerun

    monkeypatch.setenv("STORE_JOB_LOG", str(tmp_path / "whole.log"))
    hidden, logits = store_job.sweep(model, ids, tmp_path / "whole")
    ref_hidden, ref_logits = alone(model, ids)
    back = interlace.open_sweep(folder)
    assert list(back.finished) == list(range(store_job.N_ITEMS))
    for got, whole, ref in ((back["hidden"], hidden, ref_hidden),
                            (back["logits"], logits, ref_logits)):
        assert len(got) == len(whole) == len(ref) == store_job.N_ITEMS
        for a, b, c in zip(got, whole, ref):
            assert a.dtype == torch.float32 and torch.equal(a, b) and torch.equal(a, c)
    table = datasets.load_from_disk(str(folder))
    assert list(table["index"]) == list(range(store_job.N_ITEMS))
    assert torch.equal(table.with_format("torch")[17]["hidden"], ref_hidden[17])


def test_datasets_reads_one_row_per_item(model, tmp_path, corrupt):
    cells = [{"layer": layer, "pos": pos} for layer in range(2) for pos in range(3)]
    with torch.no_grad(), model.sweep(cells, input=corrupt, batch_size=4, progress=False,
                                      save_to=tmp_path / "d") as sweep:
        cell = sweep.item
        model.transformer.h[cell["layer"]].output[:, cell["pos"]] = 0
        if cell["pos"] == 1:
            row = model.transformer.h[1].output[0, : cell["layer"] + 2].save()  # shapes differ
        top = model.lm_head.output[0, -1].argmax().item().save()
        word = str(cell["pos"]).save()
    assert isinstance(row, interlace.sweeps.store.StoredColumn)
    assert [r is None for r in row] == [c["pos"] != 1 for c in cells]
    assert [tuple(r.shape) for r in row if r is not None] == [(2, 64), (3, 64)]
    assert list(sweep.results.finished) == cells
    frame = sweep.results.to_pandas()
    assert list(frame.columns) == ["layer", "pos", "row", "top", "word"]
    table = datasets.load_from_disk(str(tmp_path / "d"))
    assert table.column_names == ["index", "layer", "pos", "row", "top", "word"]
    assert list(table["word"]) == [str(c["pos"]) for c in cells]
    assert list(table["top"]) == list(top)
    for cell in cells:  # one trace per item
        with torch.no_grad(), model.trace(corrupt):
            model.transformer.h[cell["layer"]].output[:, cell["pos"]] = 0
            ref = model.lm_head.output[0, -1].argmax().item().save()
        assert top[cells.index(cell)] == ref


def test_bfloat16_round_trips(model, tmp_path, corrupt):
    with torch.no_grad(), model.sweep(range(3), input=corrupt, progress=False,
                                      save_to=tmp_path / "bf") as sweep:
        h = (model.transformer.h[0].output[:, sweep.item] * 1.37).to(torch.bfloat16).save()
    with torch.no_grad(), model.trace(corrupt):
        ref = (model.transformer.h[0].output[:, 2] * 1.37).to(torch.bfloat16).save()
    for got in (h[2], interlace.open_sweep(tmp_path / "bf")["h"][2]):
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    raw = datasets.load_from_disk(str(tmp_path / "bf")).with_format("torch")["h"][2]
    assert torch.equal(raw.to(torch.int16).view(torch.bfloat16), ref)  # its 16 bits as uint16


def _sweep(model, ids, folder, scale=1.0, overwrite=False):
    with torch.no_grad(), model.sweep(range(len(ids)), input=lambda i: ids[i:i + 1],
                                      batch_size=2, progress=False, save_to=folder,
                                      overwrite=overwrite) as sweep:
        h = (model.transformer.h[0].output * scale).save()
    return h


def test_a_changed_body_items_or_model_refuses_to_resume(model, gpt2, tmp_path):
    ids = torch.randint(0, 1000, (4, 8), generator=torch.Generator().manual_seed(5))
    folder = tmp_path / "r"
    first = _sweep(model, ids, folder)
    again = _sweep(model, ids, folder)  # all finished: nothing runs, the same values
    assert all(torch.equal(a, b) for a, b in zip(first, again))

    with pytest.raises(interlace.InterlaceError, match="values of the body's variables scale"):
        _sweep(model, ids, folder, scale=2.0)
    with pytest.raises(interlace.InterlaceError, match=r"body's source") as info:
        with torch.no_grad(), model.sweep(range(4), input=lambda i: ids[i:i + 1],
                                          progress=False, save_to=folder) as sweep:
            h = model.transformer.h[1].output.save()  # noqa: F841
    assert str(folder) in str(info.value) and "overwrite=True" in str(info.value)
    other = ids.clone()
    other[2, 3] += 1
    with pytest.raises(interlace.InterlaceError, match="finished item 2 that differs"):
        _sweep(model, other, folder)
    import copy

    edited = copy.deepcopy(gpt2)
    with torch.no_grad():
        edited.transformer.h[1].mlp.c_fc.weight[0, 0] += 1  # among the sampled weights
    with pytest.raises(interlace.InterlaceError, match="the model's weights"):
        _sweep(interlace.Model(edited), ids, folder)
    fresh = _sweep(model, other, folder, overwrite=True)
    with torch.no_grad(), model.trace(other[2:3]):
        ref = model.transformer.h[0].output.save()
    assert torch.equal(fresh[2], ref)


def test_values_that_cannot_be_stored_are_refused_at_the_first_batch(model, tmp_path, corrupt):
    with pytest.raises(interlace.InterlaceError, match="'pair' is a list") as info:
        with torch.no_grad(), model.sweep(range(3), input=corrupt, progress=False,
                                          save_to=tmp_path / "x") as sweep:
            pair = [model.transformer.h[0].output, model.transformer.h[1].output].save()  # noqa
    assert "sweep item 0" in str(info.value)
    with pytest.raises(interlace.InterlaceError, match="is not an interlace sweep folder"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "notes.txt").write_text("mine")
        _sweep(model, corrupt, tmp_path / "other")


def test_a_forward_keyword_named_like_a_sweep_option_goes_through_inputs(tmp_path):
    class Scaled(torch.nn.Module):
        def forward(self, x, save_to=1.0, progress=1.0):
            return x * save_to + progress

    wrapped = interlace.Model(Scaled())
    xs = torch.arange(6.0).reshape(3, 2)
    with torch.no_grad(), wrapped.sweep(
            range(3), input=lambda i: interlace.Inputs(xs[i:i + 1], save_to=3.0, progress=0.5),
            progress=False, save_to=tmp_path / "k") as sweep:
        out = sweep.output.save()
    assert torch.equal(out[1], xs[1:2] * 3.0 + 0.5)


def test_without_datasets_save_to_says_how_to_install(model, monkeypatch, corrupt, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"interlace\[datasets\]"):
        with model.sweep(range(2), input=corrupt, save_to=tmp_path / "n") as sweep:
            sweep.output.save()


MEMORY_JOB = r"""
import json, os, sys, torch, interlace
from benchmarks.measure import TensorPeak

def rss():  # anonymous memory: the shards' pages mapped for reading back are the files'
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["RssAnon"].split()[0]) * 1024

torch.manual_seed(0)
model = interlace.Model(torch.nn.Sequential(torch.nn.Linear(6, 256), torch.nn.ReLU(),
                                            torch.nn.Linear(256, 4)).eval())
x = torch.randn(1, 6)
out = {}
for n in (5_000, 50_000):
    with torch.no_grad(), TensorPeak() as peak:
        with model.sweep(range(n), input=x, batch_size=500, progress=False,
                         save_to=os.path.join(sys.argv[1], str(n))) as sweep:
            model[1].output[:, sweep.item % 256] = 1.0
            h = model[1].output.save()     # 1 KB per item: 50 MB for 50k items in memory
    assert len(h) == n and h[n - 1][0, (n - 1) % 256] == 1.0
    del h, sweep
    out[n] = {"peak": peak.peak, "rss": rss()}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_fifty_thousand_items_keep_memory_flat(tmp_path):
    """Tensor storage as benchmarks/ counts it (`measure.TensorPeak`) and the anonymous resident
    set, after 5k and after 50k items, with malloc returning big blocks (MALLOC_MMAP_THRESHOLD_).
    In memory, the 50k items' values alone would take 50 MB."""
    root = os.path.dirname(SRC)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([SRC, root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", MEMORY_JOB, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    small, big = (v for _, v in sorted(json.loads(done.stdout.splitlines()[-1]).items(),
                                       key=lambda kv: int(kv[0])))
    assert big["peak"] <= 1.25 * small["peak"] + 65536, (small, big)
    assert big["peak"] < 4e6  # a batch's values, not 50 MB of them
    assert big["rss"] - small["rss"] < 16e6, (small, big)


@pytest.mark.slow
def test_ray_workers_write_their_own_shards(ray_cluster, model, tmp_path):
    ids = torch.randint(0, 1000, (10, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), model.sweep(range(10), input=lambda i: ids[i:i + 1], batch_size=2,
                                      executor="ray", workers=2, progress=False,
                                      save_to=tmp_path / "ray") as sweep:
        h = model.transformer.h[1].output[:, -1].save()
    manifests = sorted(p.name for p in (tmp_path / "ray").glob("interlace-manifest-*"))
    assert len(manifests) == 2 and all("-w" in m for m in manifests)  # one per worker
    ref = _sweep_last(model, ids)
    assert len(h) == 10 and all(torch.equal(a, b) for a, b in zip(h, ref))
    table = datasets.load_from_disk(str(tmp_path / "ray"))
    assert sorted(table["index"]) == list(range(10))


def _sweep_last(model, ids):
    out = []
    for i in range(len(ids)):
        with torch.no_grad(), model.trace(ids[i:i + 1]):
            out.append(model.transformer.h[1].output[:, -1].save())
    return out


def test_a_batch_of_items_hashes_as_each_item_alone():
    """The manifest's hashes are taken a batch at once (`item_digests`); resuming compares
    them with each item's `item_digest` as it is drawn again: they must be the same strings,
    and the same as before hashing went by batch (folders written then still resume)."""
    from interlace.sweeps.runner import Entry
    from interlace.sweeps.store import item_digest, item_digests

    ids = torch.arange(16).reshape(2, 8)
    pinned = Entry(1, ids[1], (ids[1][None],), {}, None)
    assert item_digests([pinned], True) == ["4ea34e1a5b5530e7d6a697248bf8d7cf"]
    assert item_digests([pinned], False) == ["4c4df35c1e8f6123bd6776d19f752bd7"]

    x = torch.randn(4, 3, 5, requires_grad=True)
    batches = {
        "token rows": [Entry(i, t, (t[None],), {}, None) for i, t in enumerate(ids)],
        "two inputs": [Entry(i, x[i], (x[i], x[i].T), {}, None) for i in range(4)],
        "no inputs": [Entry(i, x[i], (), {}, None) for i in range(4)],
        "bfloat16, 0-dim": [Entry(i, x[i, 0, 0].to(torch.bfloat16), (x[i, 0],), {}, None)
                            for i in range(4)],
        "keywords": [Entry(i, x[i], (), {"mask": x[i]}, None) for i in range(4)],
        "shapes differ": [Entry(i, x[i, :i + 1], (x[i, :i + 1],), {}, None) for i in range(4)],
        "other items": [Entry(i, {"i": i, "t": x[i]}, (x[i],), {}, None) for i in range(4)],
        "dtypes differ": [Entry(i, x[i].double() if i else x[i], (), {}, None) for i in range(2)],
    }
    for name, entries in batches.items():
        for per_item in (True, False):
            alone = [item_digest(None, e, per_item) for e in entries]
            assert item_digests(entries, per_item) == alone, (name, per_item)
            assert len(set(alone)) == len(alone), name  # items that differ hash apart


def test_batches_of_mixed_values_are_stored_as_in_memory(model, tmp_path, corrupt):
    """Columns are converted a batch at once where the rows agree and row by row where they do
    not (shapes, None slots after the column's type is known, ints in a float column, an item
    field save_to= cannot store): both ways give what the in-memory sweep holds."""
    items = [{"i": i, "tag": [i]} for i in range(10)]

    def run(**store):
        with torch.no_grad(), model.sweep(items, input=corrupt, batch_size=4, progress=False,
                                          **store) as sweep:
            i = sweep.item["i"]
            if i % 3 != 1:
                last = model.transformer.h[0].output[0, -1].save()
            row = model.transformer.h[1].output[0, : 2 + (i >= 6) + (i == 9)].save()
            score = (i * 10 if i % 2 else i + 0.5).save()
            flag = (i > 4).save()
        return sweep.results

    mem, disk = run(), run(save_to=tmp_path / "m")
    for name in ("row", "last", "score", "flag"):
        a, b = list(mem[name]), list(disk[name])
        assert len(a) == len(b) == 10, name
        for x, y in zip(a, b):
            assert (x is None and y is None) or (torch.equal(x, y) if isinstance(x, torch.Tensor)
                                                 else x == y), (name, x, y)
    assert [type(f) for f in disk["flag"]] == [bool] * 10  # an int in a float column: a float
    table = datasets.load_from_disk(str(tmp_path / "m"))
    assert list(table["tag"]) == [repr([i]) for i in range(10)]


def test_a_shards_schema_in_its_manifest_line_is_the_files(model, tmp_path, corrupt):
    """A sweep's end takes each shard's schema from its manifest line (its column names, the
    column types known when it was written) instead of reading every file: that schema must be
    the file's, for every kind of column; a shard written while a column was all None, and a
    folder whose manifest lines do not name their columns (written before they did), are read
    from the files and still open with `datasets` as the in-memory sweep holds them."""
    from interlace.sweeps.store import MANIFEST, _schema, _schema_of, read_manifests

    items = [{"i": i, "name": f"n{i}"} for i in range(9)]

    def run(folder=None):
        with torch.no_grad(), model.sweep(items, input=corrupt, batch_size=3, progress=False,
                                          **({"save_to": folder} if folder else {})) as sweep:
            i = sweep.item["i"]
            h = model.transformer.h[0].output
            grid = h[0, :2].save()                                  # float32, 2 dimensions
            cube = h[:, :2, :3].to(torch.bfloat16).save()           # bfloat16, 3 dimensions
            top = h[0, -1].argmax().save()                          # int64, 0 dimensions
            mask = (h[0, -1] > 0).save()                            # bool, 1 dimension
            count = (i * 2 + 100).save()  # not 0: saving an int marks the object (i is 0 too)
            score = (i + 0.5).save()
            word = str(i).save()
            flag = (i > 4).save()
            if i >= 3:
                late = h[0, 0].save()  # all None in the first shard: typed by a rewrite
        return sweep.results

    mem, disk = run(), run(tmp_path / "s")
    shards = read_manifests(str(tmp_path / "s"))
    with open(tmp_path / "s" / "interlace-sweep.json") as f:
        columns = json.load(f)["columns"]
    assert len(shards) == 3 and all("names" in entry for entry in shards)
    for entry in shards:
        assert _schema_of(entry["names"], columns).equals(
            _schema(str(tmp_path / "s" / entry["shard"])), check_metadata=False), entry["shard"]

    def same(results):
        for name in ("grid", "cube", "top", "mask", "count", "score", "word", "flag", "late"):
            for x, y in zip(mem[name], results[name], strict=True):
                assert (x is None and y is None) or (
                    torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), (name, x, y)

    same(disk)
    for manifest in (tmp_path / "s").glob(MANIFEST + "*"):  # as written before lines had names
        lines = [json.loads(line) for line in manifest.read_text().splitlines()]
        manifest.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "names"})
                                    + "\n" for line in lines))
    same(run(tmp_path / "s"))  # resumed: nothing to run, every shard's schema read from its file
    table = datasets.load_from_disk(str(tmp_path / "s"))
    assert list(table["index"]) == list(range(9)) and list(table["count"]) == [2 * i + 100 for i in range(9)]


def test_rows_written_with_their_batch_are_read_in_place_and_buffered_rows_own_their_values(
        model, tmp_path):
    """With save_to=, a batch's saved views are written straight from the batch's tensors (no
    copy per item); a row that stays buffered past its batch (a smaller batch of another key,
    a batch that finished before the items ahead of it) is compacted first, so that it never
    pins its batch. Both give each item's values alone."""
    from interlace.sweeps.results import _pins_more
    from interlace.sweeps.runner import Entry, InOrder
    from interlace.sweeps.store import Sink, Store

    big = torch.randn(8, 5, 64)
    views = [{"h": big[i, -1]} for i in range(8)]  # each pins the whole of `big`
    assert all(_pins_more(v["h"]) for v in views)
    store = Store(tmp_path / "unit", {"format": 0}, ["h"])
    sink = Sink(store, type("Job", (), {"input": None})(), "t")
    sink.flush_rows = 8
    entries = [Entry(i, i, (), {}, None) for i in range(8)]
    assert sink.add_many(entries[:3], views[:3]) == 0  # buffered: compacted
    assert not any(_pins_more(row[3]["h"]) for row in sink.rows)
    assert sink.add_many(entries[3:], views[3:]) > 0  # the shard: written from the views
    assert sink.rows == []

    parked = []
    done = InOrder(lambda es, vs: parked.extend(vs))
    done.many(entries[4:], views[4:])  # ahead of items 0-3: they wait, compacted
    assert parked == [] and not any(_pins_more(v["h"]) for _, v in done.waiting.values())

    # end to end: windows of two lengths, so batches are partial and finish out of order
    windows = [torch.randint(0, 1000, (1, 4 + 2 * (i // 3 % 2)),
                             generator=torch.Generator().manual_seed(i)) for i in range(11)]
    with torch.no_grad(), model.sweep(windows, batch_size=4, progress=False,
                                      save_to=tmp_path / "e2e") as sweep:
        last = model.transformer.h[0].output[0, -1].save()
    for i, window in enumerate(windows):
        with torch.no_grad(), model.trace(window):
            h = model.transformer.h[0].output[0, -1].save()
        # (batched, BLAS may split the matmuls otherwise than for one window: 1e-5 apart)
        torch.testing.assert_close(sweep.results["last"][i], h, rtol=1e-4, atol=1e-5, msg=str(i))
