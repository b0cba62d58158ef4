"""What one wrapped model knows across traces: its locations and the order they happen in.

A *location* is a small integer key: `2 * i` is module `i`'s input, `2 * i + 1` its output
(modules numbered as `named_modules()` lists them), `2 * n` the run's result, and keys above
that are locations inside a forward (`source.py`), added on first use and stable for the
model's life.

The first trace of a model hooks every module and records the order of locations in one root
call (`learn`); later traces hook only what bodies ask for and derive the count of every
unhooked location from the position of the last hooked one (the hot path's `Hub`). That is
what makes "already passed" detectable and `OutOfOrderError` precise.

Known limit: the learned order assumes every root call visits modules in the same order. A
model whose module order depends on its input can get a false "already produced" from a
request the learned order places earlier than it really runs.
"""

from __future__ import annotations

import torch


class ModelState:
    """The locations of one module tree and their learned order (no lock, no run, no Envoy)."""

    def __init__(self, root):
        self.root = root
        self.modules = []
        self.paths = []
        self.index = {}
        for name, module in root.named_modules():
            self.index[id(module)] = len(self.modules)
            self.modules.append(module)
            self.paths.append("model." + name if name else "model")
        # Each module's instance `forward` as it was when the model was wrapped (None: the
        # class's), and the modules warned about since (hooks.check_forward).
        self.forwards = [m.__dict__.get("forward") for m in self.modules]
        self.forward_warned = set()
        by_path = {path: i for i, path in enumerate(self.paths)}
        # ancestors[i]: the modules that contain module i and are themselves called (root and
        # containers without a forward of their own, ModuleList/ModuleDict, excluded)
        callable_ = [type(m).forward is not torch.nn.Module.forward for m in self.modules]
        self.ancestors = []
        for path in self.paths:
            parts = path.split(".")
            chain = (by_path.get(".".join(parts[:j])) for j in range(2, len(parts)))
            self.ancestors.append(tuple(i for i in chain if i is not None and callable_[i]))
        n = len(self.modules)
        self.nkeys = 2 * n + 1
        self.result_key = 2 * n
        self.order = None  # key ids of one root call, learned on the first trace
        self.visits = None
        self.positions = None
        # Locations beyond the modules (operations inside a forward, see source.py) get keys
        # above result_key, allocated on first use and stable for the model's life.
        self.extra = {}  # owner -> first key of its block
        self.extra_names = []
        # What a probe run of one item alone saw at each location (probe.py): which dim of
        # each value carries the batch. None until the model's first batched run.
        self.layouts = None

    def add_locations(self, owner, names):
        """The first of `len(names)` keys for locations `owner` adds (the same keys every time)."""
        base = self.extra.get(owner)
        if base is None:
            base = self.extra[owner] = self.nkeys
            self.extra_names.extend(names)
            self.nkeys += len(names)
            if self.visits is not None:  # never in the learned order: derived counts are 0
                self.visits += (0,) * len(names)
                self.positions += ((),) * len(names)
        return base

    def key_name(self, key):
        if key == self.result_key:
            return "tracer.result"
        if key > self.result_key:
            return self.extra_names[key - self.result_key - 1]
        return f"{self.paths[key >> 1]}.{'output' if key & 1 else 'input'}"

    def learn(self, record):
        """Keep the order of locations of the first root call seen in `record`."""
        root_in = 0
        starts = [i for i, key in enumerate(record) if key == root_in]
        if not starts:
            return
        end = starts[1] if len(starts) > 1 else len(record)
        order = tuple(k for k in record[starts[0]:end] if k < self.result_key)
        positions = [[] for _ in range(self.nkeys)]
        for i, key in enumerate(order):
            positions[key].append(i)
        self.positions = tuple(tuple(p) for p in positions)
        self.visits = tuple(len(p) for p in positions)
        self.order = order

    def ran_summary(self, record=None, limit=12):
        """The modules of one root call in the order they finish (for error messages)."""
        order = self.order if self.order is not None else record
        if not order:
            return "unknown (the module order has not been learned yet)"
        names = [self.paths[k >> 1] for k in order if k & 1 and k < self.result_key]
        more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more
