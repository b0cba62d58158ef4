"""`model.sweep(items, ..., save_to=path)`: saved values streamed to a `datasets` folder.

A sweep that collects activations over a token dataset saves far more than memory holds and
runs for hours. With `save_to=`, each finished item becomes one row of an Arrow shard, written
batch by batch, so memory stays flat and a crash loses at most the batch in flight:

- the folder is a Hugging Face `datasets` folder (`datasets.load_from_disk(path)` opens it):
  Arrow stream shards `data-<run>-<n>.arrow`, `state.json`, `dataset_info.json`; one row per
  item: `index`, the item's fields, one column per saved name (tensors as nested lists, so
  per-item shapes may differ; bfloat16 as its raw 16 bits, the dtype in the header);
- crash safety: a shard is written under a temporary name, synced and renamed; then one line
  naming it, its columns and its items (index and a hash of each item and its inputs) is
  appended to the writer's manifest `interlace-manifest-<run>.jsonl`. A shard no line names, or a
  torn last line, is the batch in flight: dropped when the folder is opened again;
- resume: `interlace-sweep.json` (the header) records what made the rows: the body (its source
  and a hash of the caller's values it reads), the model (class, config, parameter shapes, a
  checksum of sampled weights), the inputs (a shared input, keywords); a sweep into a folder
  whose header differs is refused naming what differs (`overwrite=True` starts over). Items
  are compared as they are drawn again (they are read lazily): a finished item is skipped
  when its hash matches, refused when it does not;
- Ray workers write shards and manifests of their own (`Sink`); the driver merges them.

`datasets` and `pyarrow` are imported only when a sweep has `save_to=` (`interlace[datasets]`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import math
import operator
import os
import types
import uuid
from collections.abc import Mapping

import torch

from ..errors import InterlaceError
from .results import SweepResults, compact, item_fields

FORMAT = 1
HEADER = "interlace-sweep.json"
MANIFEST = "interlace-manifest-"
INSTALL = "pip install 'interlace[datasets]' (or pip install datasets)"
INDEX = "index"


def require():
    """Check now that `datasets` is installed (it is imported when the sweep ends: it takes
    seconds; pyarrow, which writes the shards, is imported now)."""
    import importlib.util

    try:
        if importlib.util.find_spec("datasets") is None:
            raise ImportError("datasets")
        import pyarrow  # noqa: F401
    except (ImportError, ValueError):
        from ..errors import MissingExtraError

        raise MissingExtraError(
            f"model.sweep(..., save_to=...) writes a Hugging Face datasets folder, and datasets "
            f"is not installed here: {INSTALL}; or leave out save_to= to keep the values in memory"
        ) from None


class Stored:
    """What a Ray worker sends back for an item it wrote itself: the bytes it took."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes):
        self.nbytes = nbytes

    def __reduce__(self):
        return (Stored, (self.nbytes,))


# -- hashes: what resuming compares ------------------------------------------------------------


def digest(value):
    """A stable hex hash of `value`: tensors and arrays by content, containers element-wise,
    functions by their code, the model and other objects by their type."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value, 0)
    return h.hexdigest()


def _feed(h, value, depth):
    if depth > 8:
        h.update(b"deep")
        return
    kind = type(value)  # exact types first: an item's hash is taken per item, in the hot path
    if kind is torch.Tensor:
        _feed_tensor(h, value)
    elif kind is tuple or kind is list or kind is dict:
        h.update(_seq_tag(kind, len(value)))
        if kind is dict:
            for k, v in value.items():
                _feed(h, k, depth + 1)
                _feed(h, v, depth + 1)
        else:
            for v in value:
                _feed(h, v, depth + 1)
        h.update(b"}" if kind is dict else b"]")
    elif value is None or kind in _SCALARS:
        h.update(f"{kind.__name__}:{value!r};".encode())
    elif isinstance(value, torch.Tensor):
        _feed_tensor(h, value)
    elif isinstance(value, (bool, int, float, complex, str, bytes)):  # subclasses (enums...)
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        h.update(f"numpy:{value.dtype}:{getattr(value, 'shape', ())};".encode())
        h.update(value.tobytes())
    elif isinstance(value, (list, tuple, set, frozenset)):
        h.update(f"{type(value).__name__}:{len(value)}[".encode())
        for v in (sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value):
            _feed(h, v, depth + 1)
        h.update(b"]")
    elif isinstance(value, Mapping):  # dicts, a tokenizer's BatchEncoding
        h.update(f"{type(value).__name__}:{len(value)}{{".encode())
        for k, v in value.items():
            _feed(h, k, depth + 1)
            _feed(h, v, depth + 1)
        h.update(b"}")
    elif isinstance(value, types.FunctionType):
        h.update(f"function:{value.__qualname__};".encode())
        _feed_code(h, value.__code__, depth)
        _feed(h, value.__defaults__, depth + 1)
    elif isinstance(value, types.CodeType):
        _feed_code(h, value, depth)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        h.update(f"dataclass:{type(value).__qualname__};".encode())
        _feed(h, [getattr(value, f.name) for f in dataclasses.fields(value)], depth + 1)
    else:  # the model, Envoys, modules, the sweep, other objects: by type (see Header)
        h.update(f"object:{type(value).__module__}.{type(value).__qualname__};".encode())


def _feed_tensor(h, value):
    h.update(_tensor_tag(value))
    if value.layout == torch.strided and not value.is_meta:
        h.update(_raw(value.detach() if value.requires_grad else value))


def _tensor_tag(value):
    tag = _TAGS.get((value.dtype, value.shape))
    if tag is None:
        tag = _tag((value.dtype, value.shape), f"tensor:{value.dtype}:{tuple(value.shape)};")
    return tag


def _seq_tag(kind, length):
    """What opens a list's, tuple's or dict's hash."""
    tag = _TAGS.get((kind, length))
    if tag is None:
        tag = _tag((kind, length), f"{kind.__name__}:{length}{'{' if kind is dict else '['}")
    return tag


_TAGS = {}  # (type, length) or (dtype, shape) -> the bytes that open its hash


def _tag(key, text):
    if len(_TAGS) > 4096:  # per-item shapes that all differ: bounded
        _TAGS.clear()
    tag = _TAGS[key] = text.encode()
    return tag


_DTYPE = operator.attrgetter("dtype")


_SCALARS = frozenset((bool, int, float, complex, str, bytes))


def _feed_code(h, code, depth):
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        _feed(h, const, depth + 1)


def _raw(tensor):
    """A tensor's elements as a contiguous numpy array (bfloat16 as its raw uint16 bits)."""
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view("uint16")
    return tensor.numpy()


def model_header(model):
    """What identifies the model's values: class, config, parameter shapes, sampled weights."""
    from ..intervention.access import module_of

    module = module_of(model)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
        config = json.dumps(config, sort_keys=True, default=repr)
    shapes = []
    sample = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, p in module.named_parameters():
            shapes.append((name, tuple(p.shape), str(p.dtype)))
            flat = p.detach().reshape(-1)
            if flat.numel() and flat.device.type != "meta":
                sample.update(_raw(flat[_picks(flat.numel(), flat.device)]).tobytes())
    return {"class": f"{type(module).__module__}.{type(module).__qualname__}",
            "config": digest(config), "parameter shapes": digest(shapes),
            "weights": sample.hexdigest()}


def _picks(numel, device):
    """The positions of the (at most 64) weights sampled from a parameter of `numel`."""
    picks = _PICKS.get((numel, device))
    if picks is None:
        if len(_PICKS) > 4096:
            _PICKS.clear()
        picks = _PICKS[numel, device] = torch.linspace(
            0, numel - 1, min(64, numel)).long().to(device)
    return picks


_PICKS = {}  # (numel, device) -> positions: a model's parameters share a few sizes


def make_header(tracer, job):
    import ast

    block = tracer.block
    assigned = set(block.assigned_names)  # what it assigns (its saved names) is not an input
    names = {name: digest(value) for name, value in sorted(job.namespace.items())
             if name not in assigned and not isinstance(value, type(tracer))}
    # the body's syntax tree without positions: the same body moved or re-indented is the same
    source = ast.dump(ast.Module(body=list(block.statements or ()), type_ignores=[]))
    shared = job.input is not None and not is_callable_input(job.input)
    return {
        "format": FORMAT,
        "body": {"source": digest(source), "variables": names},
        "model": model_header(tracer.model),
        "inputs": {"input": digest(job.input) if shared else "per item",
                   "keywords": digest(job.kwargs), "generate": bool(job.generate)},
    }


def is_callable_input(source):
    return callable(source) and not isinstance(source, torch.nn.Module)


def item_digest(job, entry, per_item=None):
    """An item's hash: the item, and its inputs when `input=` makes them from it
    (`per_item`: whether it does, when the caller knows)."""
    if per_item is None:
        per_item = job.input is not None and is_callable_input(job.input)
    if per_item:
        return digest((entry.item, entry.args, entry.kwargs))
    return digest(entry.item)


def item_digests(entries, per_item):
    """`item_digest` of each entry, the same hex strings, for a batch at once where it can:
    when every item is a tensor of one dtype and shape (and, with `per_item`, its inputs are a
    tuple of such tensors and no keywords), each position's tensors are stacked and turned to
    bytes once, and an item's hash is its bytes between the tags `digest` writes."""
    parts = _stacked_parts(entries, per_item)
    if parts is None:
        return [digest((e.item, e.args, e.kwargs)) if per_item else digest(e.item)
                for e in entries]
    blake2b = hashlib.blake2b
    hashes = []
    for i in range(len(entries)):
        h = blake2b(digest_size=16)
        for tag, rows, size in parts:
            h.update(tag)
            if rows is not None:
                h.update(rows[i * size:(i + 1) * size])
        hashes.append(h.hexdigest())
    return hashes


def _stacked_parts(entries, per_item):
    """[(tag bytes, the tensors' bytes of every entry or None, bytes per entry)] in the order
    `digest` feeds them, or None when the entries are not all alike (see `item_digests`)."""
    if not entries:
        return None
    columns = [[e.item for e in entries]]
    if per_item:
        args = [e.args for e in entries]
        if set(map(type, args)) != {tuple} or len(set(map(len, args))) != 1:
            return None
        if set(map(type, [e.kwargs for e in entries])) != {dict} or any(
                map(len, [e.kwargs for e in entries])):
            return None
        columns += [[a[j] for a in args] for j in range(len(args[0]))]
    stacked = []
    for values in columns:
        first = values[0]
        if (set(map(type, values)) != {torch.Tensor} or len(set(map(_DTYPE, values))) != 1
                or first.layout != torch.strided or first.is_meta):
            return None
        try:
            with torch.no_grad():
                data = _raw(torch.stack(values)).reshape(-1)
        except RuntimeError:  # shapes that differ (stack checks them), several devices
            return None
        stacked.append((_tensor_tag(first), memoryview(data.view("uint8")),
                        data.nbytes // len(values)))
    if not per_item:
        return stacked
    args = len(stacked) - 1  # digest((item, args, kwargs)): the tags around the tensors
    chunks = [(_seq_tag(tuple, 3) + stacked[0][0],) + stacked[0][1:]]
    opening = _seq_tag(tuple, args)
    for tag, rows, size in stacked[1:]:
        chunks.append((opening + tag, rows, size))
        opening = b""
    chunks.append((opening + b"]" + _seq_tag(dict, 0) + b"}]", None, 0))
    return chunks


def _differences(path, old, new):
    """What differs between the header on disk and this sweep's, in words (empty: none)."""
    found = []
    if old.get("format") != new["format"]:
        found.append(f"its format ({old.get('format')} on disk, {new['format']} here)")
    body_old, body_new = old.get("body", {}), new["body"]
    if body_old.get("source") != body_new["source"]:
        found.append("the body's source")
    changed = sorted(name for name in set(body_old.get("variables", {})) | set(body_new["variables"])
                     if body_old.get("variables", {}).get(name) != body_new["variables"].get(name))
    if changed:
        found.append(f"the values of the body's variables {', '.join(changed)}")
    model_old = old.get("model", {})
    for key, value in new["model"].items():
        if model_old.get(key) != value:
            found.append(f"the model's {key}"
                         + (f" ({model_old.get(key)} on disk, {value} here)" if key == "class" else ""))
    inputs_old = old.get("inputs", {})
    for key, value in new["inputs"].items():
        if inputs_old.get(key) != value:
            found.append(f"the sweep's {'shared input' if key == 'input' else key}")
    return found


# -- the folder ---------------------------------------------------------------------------


class Store:
    """One sweep's folder, opened by the driver: checks the header, knows the finished items.

    Pickled (to Ray workers) as its path, run id and column types: see `Sink`.
    """

    def __init__(self, path, header, saved, overwrite=False):
        require()
        self.path = os.path.abspath(os.fspath(path))
        self.run = uuid.uuid4().hex[:8]
        self.saved = list(saved)
        os.makedirs(self.path, exist_ok=True)
        header_path = os.path.join(self.path, HEADER)
        if overwrite:
            _clear(self.path)
        elif os.path.exists(header_path):
            with open(header_path) as f:
                old = json.load(f)
            found = _differences(self.path, old, header)
            if found:
                raise InterlaceError(
                    f"save_to={self.path!r} holds a sweep that differs from this one in "
                    f"{'; '.join(found)}: it cannot resume there. Pass overwrite=True to start "
                    f"over in that folder, or choose another save_to"
                )
            header = {**old, **header}
        elif any(not name.startswith(".") for name in os.listdir(self.path)):
            raise InterlaceError(
                f"save_to={self.path!r} exists and is not an interlace sweep folder (it has no "
                f"{HEADER}); choose a new or empty folder, or pass overwrite=True to write there "
                f"anyway"
            )
        self.header = header
        self.header.setdefault("columns", {})
        self.header.setdefault("fields", None)
        _write_json(header_path, self.header)
        self.finished = Finished(read_manifests(self.path, clean=True))
        self.writer = None
        self.nbytes = 0  # written by this sweep (the progress bar's MB/s)
        self.flush_rows = 1
        self.per_item = None  # does input= make each item's inputs (see item_digest)

    def __getstate__(self):
        return {"path": self.path, "run": self.run, "saved": self.saved,
                "header": {"columns": self.header["columns"], "fields": self.header["fields"]}}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.finished = Finished(())
        self.writer = None
        self.nbytes = 0
        self.flush_rows = 1
        self.per_item = None

    def skips(self, job, entry):
        """Is `entry` finished on disk (skip it)? Refuses an item that differs from the one there."""
        done = self.finished.get(entry.index) if self.finished.indexes.size else None
        if done is None:
            return False
        if self.per_item is None:
            self.per_item = job.input is not None and is_callable_input(job.input)
        if done != item_digest(job, entry, self.per_item):
            text = repr(entry.item)
            raise InterlaceError(
                f"save_to={self.path!r} holds a finished item {entry.index} that differs from "
                f"this sweep's item {entry.index} ({text[:80]}{'...' if len(text) > 80 else ''}): "
                f"the items (or the inputs made from them) changed, so the sweep cannot resume "
                f"there. Pass overwrite=True to start over, or choose another save_to"
            )
        return True

    def commit(self, job, entries, values):
        """Record finished items (in order, one batch's or fewer): write them (buffered), or
        count what a worker wrote."""
        if values and isinstance(values[0], Stored):
            self.nbytes += sum(v.nbytes for v in values)
            return
        if self.writer is None:
            self.writer = self.sink(job)
        self.writer.flush_rows = self.flush_rows
        self.nbytes += self.writer.add_many(entries, values)

    def flush(self):
        """Write what is buffered (the items finished before an error or Ctrl-C too)."""
        if self.writer is not None:
            self.nbytes += self.writer.flush()

    def sink(self, job, name=None):
        """A writer of shards of this run (`name` tells Ray workers' apart)."""
        return Sink(self, job, f"{self.run}-{name}" if name is not None else self.run)

    def close(self):
        """Write the `datasets` metadata for every shard on disk; the reader of the folder."""
        finalize(self.path, self.header)
        return StoredResults(self.path)


class Finished:
    """The items on disk: index -> item hash, in two arrays (24 bytes an item, not a dict's
    ~150: a resumed sweep of millions of items stays small)."""

    def __init__(self, manifests):
        import array

        import numpy as np

        indexes, hashes = array.array("q"), bytearray()
        for entry in manifests:
            for index, item_hash in entry["items"]:
                indexes.append(index)
                hashes += bytes.fromhex(item_hash)
        order = np.argsort(np.frombuffer(indexes, np.int64), kind="stable")
        self.indexes = np.frombuffer(indexes, np.int64)[order]
        self.hashes = np.frombuffer(bytes(hashes), "S16")[order] if indexes else np.zeros(0, "S16")

    def get(self, index):
        """The hex hash of item `index` on disk, or None."""
        at = int(self.indexes.searchsorted(index))
        if at < len(self.indexes) and self.indexes[at] == index:
            return self.hashes[at].ljust(16, b"\0").hex()
        return None

    def __len__(self):
        return len(self.indexes)


def _clear(path):
    names = _listing(path)
    for pattern in ("data-*.arrow", "*.tmp", MANIFEST + "*.jsonl", HEADER, "state.json",
                    "dataset_info.json"):
        for name in fnmatch.filter(names, pattern):
            os.remove(os.path.join(path, name))


def _listing(path):
    """The folder's file names, hidden ones aside (as glob would): listed once, then filtered
    by pattern (a glob per pattern lists the folder each time)."""
    return [name for name in os.listdir(path) if not name.startswith(".")]


def _write_json(path, value, sync=True):
    """Replace `path` at once (a reader sees the old file or the new one); `sync`: durably
    (the header: without it the folder is not a sweep's), else the metadata a sweep's end
    writes again."""
    tmp = f"{path}.{os.getpid()}.tmp"
    text = json.dumps(value, sort_keys=True)  # one line: json's C encoder (indent= is Python)
    with open(tmp, "w") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifests(path, clean=False):
    """Every shard a manifest line names and that exists: dicts with `shard`, `items`
    ([index, hash] pairs), `bytes`, `columns` (the column types it found), `names` (its
    columns; lines written before they named them lack it).

    With `clean`, removes what a crash left: temporary files and shards no line names.
    """
    shards = []
    names = _listing(path)
    present = set(names)
    for manifest in sorted(fnmatch.filter(names, MANIFEST + "*.jsonl")):
        with open(os.path.join(path, manifest)) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:  # a torn last line: its shard is the batch in flight
                    continue
                if entry["shard"] in present or os.path.exists(os.path.join(path, entry["shard"])):
                    shards.append(entry)
    if clean:
        named = {entry["shard"] for entry in shards}
        for name in fnmatch.filter(names, "*.tmp"):
            os.remove(os.path.join(path, name))
        for name in fnmatch.filter(names, "data-*.arrow"):
            if name not in named:
                os.remove(os.path.join(path, name))
    return shards


# -- writing rows ---------------------------------------------------------------------------


class Sink:
    """Buffers finished items and writes them as shards: one per `flush()` (about a batch)."""

    def __init__(self, store, job, name):
        self.path = store.path
        self.job = job
        self.name = name
        self.header = store.header  # its column types and item fields, filled in as found
        self.columns = store.header["columns"]
        self.saved = store.saved
        self.rows = []
        self.count = 0
        self.flush_rows = 1  # rows buffered before a shard is written (about a batch)
        self.per_item = job.input is not None and is_callable_input(job.input)

    def add(self, entry, values):
        return self.add_many((entry,), (values,))

    def add_many(self, entries, values):
        """Buffer finished items (hashed a batch at once); write a shard once there are
        `flush_rows`. Values that stay buffered past this call are compacted (`compact`): a
        saved view would pin its batch's tensors; those written now are read where they are."""
        rows = self.rows
        start = len(rows)
        rows.extend([(e.index, e.item, e, v) for e, v in zip(entries, values)])
        if len(rows) >= self.flush_rows:
            return self.flush()
        for i in range(start, len(rows)):
            index, item, entry, saved = rows[i]
            rows[i] = (index, item, entry, compact(saved))
        return 0

    def flush(self):
        """Write the buffered rows as one shard; the bytes written."""
        if not self.rows:
            return 0
        import pyarrow as pa

        rows, self.rows = self.rows, []
        table = self.encode(rows)
        hashes = item_digests([r[2] for r in rows], self.per_item)
        shard = f"data-{self.name}-{self.count:06d}.arrow"
        self.count += 1
        final = os.path.join(self.path, shard)
        tmp = final + ".tmp"
        with open(tmp, "wb") as f:
            with pa.ipc.new_stream(f, table.schema) as writer:
                writer.write_table(table)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        nbytes = os.path.getsize(final)
        kinds = {c: self.columns[c] for c in table.column_names if c in self.columns}
        line = json.dumps({"shard": shard, "items": [[r[0], h] for r, h in zip(rows, hashes)],
                           "bytes": nbytes, "columns": kinds, "names": table.column_names,
                           "fields": self.header["fields"]}) + "\n"
        # not synced: a line lost to a power cut only makes its items run again (the shard it
        # names was synced before the line was written, so a line never names a partial shard)
        # one appending write (os-level: Python's buffered file costs more than the write)
        fd = os.open(os.path.join(self.path, f"{MANIFEST}{self.name}.jsonl"),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            data = memoryview(line.encode())
            while data:  # (a regular file takes it at once, but write may take part of it)
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        return nbytes

    def encode(self, rows):
        """The rows as an Arrow table: index, the item's fields, the saved names.

        Checked and converted a column at a time (types by `set(map(...))`, tensors stacked):
        Python per row only where the rows differ (shapes, None slots, several item types).
        """
        import pyarrow as pa

        if self.header["fields"] is None:
            self.header["fields"] = list(item_fields(rows[0][1]))
        fields = self.header["fields"]
        if INDEX in fields:
            raise InterlaceError(
                f"the items have a field named {INDEX!r}, which save_to= uses for each item's "
                f"position; rename the field"
            )
        names, arrays = [INDEX], [pa.array([r[0] for r in rows], pa.int64())]
        for field, values in zip(fields, self.field_values(rows, fields)):
            names.append(field)
            arrays.append(self.column(field, values, rows, "item field"))
        saved = set(self.saved)
        for name in self.saved:
            column = name + "_saved" if name in fields or name == INDEX else name
            names.append(column)
            arrays.append(self.column(column, [r[3].get(name) for r in rows], rows,
                                      "saved value", name))
        if not saved.issuperset(set().union(*[r[3] for r in rows])):
            index, values = next((r[0], r[3]) for r in rows if not saved.issuperset(r[3]))
            raise InterlaceError(
                f"sweep item {index} saved {sorted(set(values) - saved)}, which save_to= "
                f"cannot find in the body's source; assign each saved value to a name "
                f"(`x = ... .save()`)"
            )
        return pa.Table.from_arrays(arrays, names=names)

    @staticmethod
    def field_values(rows, fields):
        """Each field's values, one per row (None where an item lacks the field)."""
        items = [r[1] for r in rows]
        found = set(map(type, items))
        if fields == ["item"] and found.issubset(_ONE_FIELD):
            if torch.Tensor not in found or found == {torch.Tensor} and 1 not in set(
                    map(torch.Tensor.numel, items)):  # what item_fields keeps as it is
                return [items]
            return [[item_fields(item)["item"] for item in items]]
        known = set(fields)
        per_row = [item_fields(item) for item in items]
        for (index, item, _, _), row in zip(rows, per_row):
            if not known.issuperset(row):
                raise InterlaceError(
                    f"sweep item {index} ({item!r:.80}) has fields {sorted(set(row) - known)} "
                    f"that the first item did not have ({fields}); save_to= stores one column "
                    f"per field: give every item the same fields"
                )
        return [[row.get(field) for row in per_row] for field in fields]

    def column(self, column, values, rows, what, name=None):
        """`values` (a new list, one per row) as an Arrow array. The column's type is the first
        value's (`kind_of`); the others are checked against it at once where they all have its
        exact type (the usual case), else one by one."""
        kind = self.columns.get(column)
        alike = kind or _first_kind(values)  # a new column's type: its first value's
        if alike is not None and _all_of(values, alike):
            kind = self.columns[column] = alike
            return encode(values, kind)
        for position, value in enumerate(values):
            if value is None:
                continue
            found = kind_of(value)
            if found is None and what == "item field":  # what cannot be stored is kept as text
                value = values[position] = repr(value)
                found = kind_of(value)
            if found is None or kind is not None and not _compatible(kind, found):
                index, item = rows[position][0], rows[position][1]
                raise InterlaceError(
                    f"sweep item {index} ({item!r:.60}) {what} {name or column!r} is "
                    f"{describe(value)}, which save_to= cannot store"
                    + (f" in a column of {describe_kind(kind)}" if found is not None else "")
                    + ": it stores tensors (any shape, one dtype and number of dimensions per "
                      "name), numbers, strings and None. Save each tensor of a list or dict "
                      "under a name of its own, or torch.stack them"
                )
            if kind is None:
                kind = self.columns[column] = found
        return encode(values, kind)


_ONE_FIELD = frozenset((torch.Tensor, int, float, str, bool))  # items that are their one field
_PYTHON = {"bool": bool, "int": int, "float": float, "str": str}
def _first_kind(values):
    first = next((v for v in values if v is not None), None)
    return None if first is None else kind_of(first)


def _all_of(values, kind):
    """Is every value None or exactly of column type `kind`? (No Python code per value.)"""
    found = set(map(type, values))
    gaps = type(None) in found
    found.discard(type(None))
    if kind["kind"] != "tensor":
        return found.issubset((_PYTHON[kind["kind"]],))
    if not found:
        return True
    if found != {torch.Tensor}:
        return False
    present = [v for v in values if v is not None] if gaps else values
    return (set(map(_DTYPE, present)) == {_DTYPES[kind["dtype"]]}
            and set(map(torch.Tensor.dim, present)) == {kind["ndim"]})


def kind_of(value):
    """The column type a value needs (a JSON-able dict), or None when it cannot be stored."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.layout != torch.strided or value.dtype not in _NUMPY:
            return None
        return {"kind": "tensor", "dtype": str(value.dtype).replace("torch.", ""),
                "ndim": value.dim()}
    for kind, types_ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if isinstance(value, types_):
            return {"kind": kind}
    return None


def _compatible(kind, found):
    return kind == found or kind == {"kind": "float"} and found == {"kind": "int"}


def describe(value):
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def describe_kind(kind):
    if kind["kind"] == "tensor":
        return f"{kind['dtype']} tensors of {kind['ndim']} dimension(s)"
    return f"{kind['kind']} values"


_NUMPY = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
          torch.bfloat16: "uint16", torch.int64: "int64", torch.int32: "int32",
          torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
_DTYPES = {str(k).replace("torch.", ""): k for k in _NUMPY}


def arrow_type(kind):
    import pyarrow as pa

    if kind is None:
        return pa.null()
    simple = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string()}
    if kind["kind"] in simple:
        return simple[kind["kind"]]
    arrow = pa.from_numpy_dtype(__import__("numpy").dtype(_NUMPY[_DTYPES[kind["dtype"]]]))
    for _ in range(kind["ndim"]):
        arrow = pa.list_(arrow)
    return arrow


def encode(values, kind):
    """One column of values (None: a null slot) as an Arrow array of type `arrow_type(kind)`."""
    import numpy as np
    import pyarrow as pa

    if kind is None:
        return pa.nulls(len(values))
    if kind["kind"] != "tensor":
        if kind["kind"] == "float":
            values = [None if v is None else float(v) for v in values]
        return pa.array(values, arrow_type(kind))
    present = [v for v in values if v is not None]
    mask = np.array([v is None for v in values]) if len(present) < len(values) else None
    ndim = kind["ndim"]
    storage = np.dtype(_NUMPY[_DTYPES[kind["dtype"]]])
    flat = shapes = None
    with torch.no_grad():
        if mask is None and values:
            try:  # one shape (the usual case): the batch's values stacked at once
                flat = _raw(torch.stack(values)).reshape(-1)
                first = values[0].shape
            except RuntimeError:  # the shapes differ
                pass
        if flat is None:
            flat = _raw(torch.cat([v.reshape(-1) for v in present])) if present else np.empty(0, storage)
            shapes = [None if v is None else tuple(v.shape) for v in values]
    if mask is None:
        mask = np.zeros(len(values), bool)
    if ndim == 0:
        full = np.zeros(len(values), storage)
        full[~mask] = flat
        return pa.array(full, mask=mask if mask.any() else None)
    array = pa.array(flat)
    if shapes is None:
        shape = (len(values),) + tuple(first)
        for level in reversed(range(1, ndim + 1)):
            count = math.prod(shape[:level])
            if count * shape[level] >= 2 ** 31:
                break
            array = pa.ListArray.from_arrays(
                pa.array(np.arange(count + 1, dtype=np.int32) * shape[level]), array)
        else:
            return array
        array = pa.array(flat)
        shapes = [tuple(first)] * len(values)
    for level in reversed(range(ndim)):
        counts = []
        for shape in shapes:
            if shape is None:
                if level == 0:
                    counts.append(np.zeros(1, np.int64))
                continue
            counts.append(np.full(math.prod(shape[:level]), shape[level], np.int64))
        counts = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        if offsets[-1] >= 2 ** 31:
            raise InterlaceError(
                "save_to=: one batch saved more than 2**31 elements under one name; "
                "pass a smaller batch_size="
            )
        array = pa.ListArray.from_arrays(
            pa.array(offsets.astype(np.int32)), array,
            mask=pa.array(mask) if level == 0 and mask.any() else None)
    return array


# -- the datasets metadata ------------------------------------------------------------------


def finalize(path, header):
    """Make the folder a `datasets` folder of every shard on disk: `state.json` (shards in item
    order) and `dataset_info.json`; shards written before a column's type was known (all its
    values None) get that type; the column types go to the header."""
    import datasets
    import pyarrow as pa

    shards = read_manifests(path)
    shards.sort(key=lambda s: min(s["items"], default=(0,))[0])  # [index, hash] pairs
    columns = header["columns"]
    for entry in shards:
        if header.get("fields") is None and entry.get("fields") is not None:
            header["fields"] = entry["fields"]
    for entry in shards:  # the types each writer found (Ray workers, earlier runs)
        for column, kind in entry.get("columns", {}).items():
            if columns.setdefault(column, kind) != kind:
                raise InterlaceError(
                    f"save_to={path!r}: {column!r} holds {describe_kind(kind)} in shard "
                    f"{entry['shard']} but {describe_kind(columns[column])} in others; save "
                    f"values of one dtype and number of dimensions under one name"
                )
    final, known = None, {}  # known: the schema of the shards with these column names
    for entry in shards:
        shard, names, kinds = entry["shard"], entry.get("names"), entry.get("columns", {})
        if names is not None and all(name == INDEX or name in kinds for name in names):
            # written when every column's type was known: with these types (`Sink.column`)
            wanted = known.get(tuple(names))
            if wanted is None:
                wanted = known[tuple(names)] = _schema_of(names, columns)
        else:  # written before the manifest named the columns, or while one was all None
            schema = _schema(os.path.join(path, shard))
            wanted = _schema_of(schema.names, columns)
            if not wanted.equals(schema, check_metadata=False):
                _rewrite(os.path.join(path, shard), wanted)
        if final is not None and wanted is not final and not final.equals(
                wanted, check_metadata=False):
            raise InterlaceError(
                f"save_to={path!r}: shard {shard} has the columns {wanted.names} but others "
                f"have {final.names}; give every item the same fields"
            )
        final = wanted
    header_path = os.path.join(path, HEADER)
    _write_json(header_path, header, sync=False)
    state = {"_data_files": [{"filename": entry["shard"]} for entry in shards],
             "_fingerprint": hashlib.blake2b(
                 "".join(entry["shard"] for entry in shards).encode(), digest_size=8).hexdigest(),
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    if final is None:
        final = pa.schema([pa.field(INDEX, pa.int64())])
        empty = os.path.join(path, "data-empty.arrow")
        with pa.OSFile(empty, "wb") as f, pa.ipc.new_stream(f, final):
            pass
        state["_data_files"] = [{"filename": "data-empty.arrow"}]
    features = datasets.Features.from_arrow_schema(final)
    info = {"citation": "", "homepage": "", "license": "", "features": features.to_dict(),
            "description": "interlace sweep: tensor dtypes (bfloat16 stored as uint16 bits) "
                           f"in {HEADER}; read it back with interlace.open_sweep(path)"}
    _write_json(os.path.join(path, "dataset_info.json"), info, sync=False)
    _write_json(os.path.join(path, "state.json"), state, sync=False)


def _schema_of(names, columns):
    """The schema of a shard with these columns, each of its type in the header."""
    import pyarrow as pa

    return pa.schema([pa.field(name, pa.int64() if name == INDEX else arrow_type(columns.get(name)))
                      for name in names])


def _schema(file):
    import pyarrow as pa

    with pa.memory_map(file) as source:
        return pa.ipc.open_stream(source).schema


def _rewrite(file, schema):
    import pyarrow as pa

    with pa.memory_map(file) as source:
        table = pa.ipc.open_stream(source).read_all()
    columns = [table.column(f.name) if table.column(f.name).type == f.type
               else pa.nulls(len(table), f.type) for f in schema]
    table = pa.Table.from_arrays(columns, schema=schema)
    tmp = file + ".tmp"
    with open(tmp, "wb") as f:
        with pa.ipc.new_stream(f, schema) as writer:
            writer.write_table(table)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


# -- reading back -----------------------------------------------------------------------------


def open_sweep(path):
    """The saved values of a sweep written with `save_to=path`, as `sweep.results` is after the
    block: name -> read-only sequence (tensors in their saved dtype, bfloat16 included)."""
    require()
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(os.path.join(path, HEADER)):
        raise InterlaceError(f"{path!r} is not a folder written by model.sweep(..., save_to=...) "
                             f"(it has no {HEADER})")
    return StoredResults(path)


class StoredResults(SweepResults):
    """`sweep.results` of a sweep with `save_to=`: backed by the folder's files (memory-mapped),
    so it holds no values. `finished` is the finished items as stored (their fields)."""

    def __init__(self, path):
        import numpy as np
        import pyarrow as pa

        super().__init__()
        self.path = path
        with open(os.path.join(path, HEADER)) as f:
            header = json.load(f)
        self._kinds = header.get("columns", {})
        self._item_fields = header.get("fields") or []
        with open(os.path.join(path, "state.json")) as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
        tables = []
        for file in files:
            with pa.memory_map(os.path.join(path, file)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        self._table = table = pa.concat_tables(tables) if tables else None
        indexes = (table.column(INDEX).to_numpy() if table is not None and table.num_rows
                   else np.zeros(0, np.int64))
        order = np.argsort(indexes, kind="stable")
        self._order = None if (order == np.arange(len(order))).all() else order
        self.indexes = indexes[order] if self._order is not None else indexes
        names = [n for n in (table.column_names if table is not None else [INDEX])
                 if n != INDEX and n not in self._item_fields]
        for column in names:
            name = column[:-len("_saved")] if column.endswith("_saved") and (
                column[:-len("_saved")] in self._item_fields
                or column[:-len("_saved")] == INDEX) else column
            self._columns[name] = StoredColumn(self, column)
        self.finished = StoredItems(self)

    def row(self, position):
        if not -len(self.indexes) <= position < len(self.indexes):
            raise IndexError(f"sweep results: position {position} out of range "
                             f"({len(self.indexes)} finished item(s))")
        position %= max(1, len(self.indexes))
        return int(self._order[position]) if self._order is not None else position

    def cell(self, column, position):
        value = self._table.column(column)[self.row(position)]
        return decode(value, self._kinds.get(column))

    def add(self, item, values):
        raise InterlaceError("a sweep's saved values on disk are read-only")

    def __repr__(self):
        names = ", ".join(self._columns)
        return (f"<SweepResults: {len(self.indexes)} item(s) in {self.path}; "
                f"saved: {names or 'nothing'}>")


class _Sequence:
    """A read-only sequence of one column, in item order (`len`, indexing, slicing, iteration)."""

    def __init__(self, results):
        self._results = results

    def __len__(self):
        return len(self._results.indexes)

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        return self.get(position)

    def __iter__(self):
        for position in range(len(self)):
            yield self.get(position)


class StoredColumn(_Sequence):
    """One saved name's values, read from the files on access."""

    def __init__(self, results, column):
        super().__init__(results)
        self.column = column

    def get(self, position):
        return self._results.cell(self.column, position)

    def __repr__(self):
        return f"<saved {self.column!r}: {len(self)} value(s) in {self._results.path}>"


class StoredItems(_Sequence):
    """The finished items as stored: the value of a one-field item, else its fields (a tuple
    for a tuple item, a dict for the others)."""

    def get(self, position):
        results = self._results
        fields = results._item_fields
        values = [results.cell(f, position) for f in fields]
        if fields == ["item"]:
            return values[0]
        if all(f == f"item_{i}" for i, f in enumerate(fields)):
            return tuple(values)
        return dict(zip(fields, values))

    def __repr__(self):
        return f"<finished items: {len(self)} in {self._results.path}>"


def decode(value, kind):
    """One Arrow cell back to its value: a tensor of its dtype and shape, a number, a string."""
    import numpy as np

    if not value.is_valid:
        return None
    if kind is None or kind["kind"] != "tensor":
        return value.as_py()
    dtype = _DTYPES[kind["dtype"]]
    if kind["ndim"] == 0:
        array = np.array([value.as_py()], _NUMPY[dtype])
        shape = ()
    else:
        values = value.values
        shape = [len(values)]
        for _ in range(kind["ndim"] - 1):
            shape.append(len(values[0]) if len(values) else 0)
            values = values.flatten()
        array = np.array(values.to_numpy(zero_copy_only=False), _NUMPY[dtype])
    tensor = torch.from_numpy(array)
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor.reshape(shape)
