"""Activation collection to disk: `model.sweep(..., save_to=)` against a hand-written hooks loop.

    python benchmarks/probes/datasets.py                  # tiny and small4 GPT-2, CPU: rows/s, MB/s
    python benchmarks/probes/datasets.py --items 4096 --shapes small4 --tokens 128

Windows of 128 tokens (512 of them) are the shape of activation collection: SAE training data
is cut into windows of 128 tokens or more. Windows of 16 tokens (1,024) are its stress case: a
forward so short that what a sweep costs per item (issue 20) shows.

Both write the same files: one Arrow stream file per batch (written under a temporary name,
synced, renamed), with the columns `index`, `item` (the token ids) and one per layer (its
output, `(tokens, n_embd)` per row; the first and the last layer), then `state.json` and `dataset_info.json`, so that
`datasets.load_from_disk` opens either folder. The hand-written loop: plain
`register_forward_hook`s on every layer, the batch's rows sliced from each output, the Arrow
arrays built from the batch's tensors at once. The sweep adds its manifest (the crash safety
and resume bookkeeping) and its per-item bodies. `python -m benchmarks --workloads datasets`
times the same two in the harness (contenders `hooks` and `interlace`, op `collect`).
Goal (issue 22): the sweep within 1.2x of the hand-written loop (128-token windows). The last columns time the same
sweep keeping its values in memory: the difference is what writing the folder adds, per row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

BATCH = 64  # items per batch (and per file), both ways


class _Stop(Exception):
    """Raised by the last layer's hook: nothing after it is needed."""


def hooks_loop(module, layers, windows, folder, batch=BATCH):
    """The hand-written loop: hooks, a forward per batch stopped after the last layer saved
    (as the sweep stops once every body is done), one Arrow file per batch."""
    import numpy as np
    import pyarrow as pa

    os.makedirs(folder, exist_ok=True)
    files = []

    def keep(module, args, output):
        outs.append(output[0] if isinstance(output, tuple) else output)

    def keep_and_stop(module, args, output):
        keep(module, args, output)
        raise _Stop

    for start in range(0, len(windows), batch):
        ids = windows[start:start + batch]
        outs = []
        handles = [layer.register_forward_hook(keep) for layer in layers[:-1]]
        handles.append(layers[-1].register_forward_hook(keep_and_stop))
        try:
            with torch.no_grad():
                module(ids)
        except _Stop:
            pass
        finally:
            for handle in handles:
                handle.remove()
        n, tokens = ids.shape
        arrays = [pa.array(np.arange(start, start + n)), _nested(ids)]
        arrays += [_nested(out) for out in outs]
        names = ["index", "item"] + [f"h{i}" for i in range(len(outs))]
        files.append(_write(folder, f"data-{len(files):06d}.arrow", pa.Table.from_arrays(arrays, names)))
    _metadata(folder, files)


def _nested(tensor):
    """(rows, a, b) -> list<list<...>> of each row, from the flat values and regular offsets."""
    import numpy as np
    import pyarrow as pa

    array = pa.array(tensor.detach().contiguous().reshape(-1).numpy())
    shape = tensor.shape
    for level in reversed(range(1, len(shape))):
        count = int(np.prod(shape[:level]))
        array = pa.ListArray.from_arrays(pa.array(np.arange(count + 1, dtype=np.int32) * shape[level]), array)
    return array


def _write(folder, name, table):
    import pyarrow as pa

    final = os.path.join(folder, name)
    with open(final + ".tmp", "wb") as f:
        with pa.ipc.new_stream(f, table.schema) as writer:
            writer.write_table(table)
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + ".tmp", final)
    return name, table.schema


def _metadata(folder, files):
    import datasets

    state = {"_data_files": [{"filename": name} for name, _ in files], "_fingerprint": "hooks",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump(state, f)
    features = datasets.Features.from_arrow_schema(files[0][1]).to_dict()
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"features": features}, f)


def sweep(model, first, last, windows, folder, batch=BATCH):
    """The same with `model.sweep(..., save_to=folder)` (any previous folder is cleared):
    `first` and `last` are the Envoys of the layers saved. `folder=None`: the same sweep with
    its values kept in memory (what writing adds is the difference)."""
    store = {} if folder is None else {"save_to": folder, "overwrite": True}
    with torch.no_grad(), model.sweep(windows, input=lambda ids: ids[None], batch_size=batch,
                                      progress=False, **store) as sweep:
        out = first.output
        h0 = (out[0] if isinstance(out, tuple) else out)[0].save()  # noqa: F841 - saved to disk
        out = last.output
        h1 = (out[0] if isinstance(out, tuple) else out)[0].save()  # noqa: F841 - saved to disk
        sweep.stop()  # nothing after the last layer is needed (the hooks loop stops there too)
    return sweep.results


def layers(module):
    """The layers both ways save: the first and the last."""
    return [module.transformer.h[0], module.transformer.h[-1]]


def windows(vocab, items, tokens):
    return torch.randint(0, vocab, (items, tokens), generator=torch.Generator().manual_seed(1))


def last_row(folder, column="h1"):
    """The last item's value of `column`, read back from the folder's last file (pyarrow), so
    that the harness compares what each way wrote."""
    import numpy as np
    import pyarrow as pa

    with open(os.path.join(folder, "state.json")) as f:
        name = json.load(f)["_data_files"][-1]["filename"]
    with pa.memory_map(os.path.join(folder, name)) as source:
        value = pa.ipc.open_stream(source).read_all().column(column)[-1]
    rows = value.values
    return torch.from_numpy(np.array(rows.flatten().to_numpy())).reshape(len(rows), -1)


def folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def build(shape):
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, embd, heads, vocab = {"tiny": (2, 64, 4, 1000), "small4": (4, 256, 4, 50257)}[shape]
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, vocab_size=vocab,
                                      n_positions=128, bos_token_id=0, eos_token_id=0)).eval()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny,small4")
    p.add_argument("--items", type=int, default=None,
                   help="windows per sweep (default: 512 of 128 tokens or more, else 1,024)")
    p.add_argument("--tokens", default="128,16", help="tokens per window, one or more")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    o = p.parse_args(argv)
    torch.set_num_threads(o.threads)
    here = os.path.dirname(os.path.abspath(__file__))  # run as a script: this file is not `datasets`
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.path.insert(0, os.path.join(here, "..", "..", "src"))
    import interlace

    root = tempfile.mkdtemp(prefix="bench-datasets-")
    print("| model | tokens | items | sweep rows/s | sweep MB/s | hooks rows/s | hooks MB/s "
          "| sweep / hooks | in memory rows/s | writing, us/row |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for shape, tokens in [(s, int(t)) for s in o.shapes.split(",") for t in o.tokens.split(",")]:
            items = o.items or (512 if tokens >= 128 else 1024)
            module = build(shape)
            model = interlace.Model(module)
            ids = windows(module.config.vocab_size, items, tokens)
            times = {"sweep": [], "hooks": [], "memory": []}
            size = {}
            first, last = model.transformer.h[0], model.transformer.h[-1]
            for _ in range(o.rounds):
                for way in ("hooks", "memory", "sweep") if _ % 2 else ("sweep", "memory", "hooks"):
                    folder = os.path.join(root, way)
                    shutil.rmtree(folder, ignore_errors=True)
                    start = time.perf_counter()
                    if way == "hooks":
                        hooks_loop(module, layers(module), ids, folder)
                    else:
                        sweep(model, first, last, ids, folder if way == "sweep" else None)
                    times[way].append(time.perf_counter() - start)
                    size[way] = folder_bytes(folder) if way != "memory" else 0
            s, h, mem = (statistics.median(times[way]) for way in ("sweep", "hooks", "memory"))
            print(f"| {shape} | {tokens} | {items} | {items / s:,.0f} | "
                  f"{size['sweep'] / s / 1e6:,.1f} | {items / h:,.0f} | "
                  f"{size['hooks'] / h / 1e6:,.1f} | {s / h:.2f}x | {items / mem:,.0f} | "
                  f"{(s - mem) / items * 1e6:.1f} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
