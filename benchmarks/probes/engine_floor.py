"""What a trace costs with interlace's tracer core and a minimal engine: where issue 20's gap is.

    python benchmarks/probes/engine_floor.py              # tiny GPT-2, save layer 0's output
    python benchmarks/probes/engine_floor.py --rounds 800

Issue 20 asks for a save-one trace within +20 us of the prototype contender (a tapped, pooled
greenlet written by hand, `benchmarks/prototype.py`). Before concluding which part of
interlace stands in the way, this isolates it: the same `with` block run seven ways, in
shuffled order round by round in one process (medians):

  prototype  the tapped pooled greenlet, no tracer (as in the harness)
  genproto   the generator-body prototype, no tracer (the harness's)
  core       interlace's real tracer core around the greenlet prototype's read
  gencore    the same around the generator prototype's read (the harness's `gencore`)
  minimal    interlace's real tracer core (the `with` captured, skipped, the body deferred
             with its names bound, run with `.save()`, the saved names written back into the
             caller) driving a minimal engine written here in plain Python: one pooled
             greenlet, a module's instance `forward` replaced when the body first waits for
             it, Envoy-like objects with `.output` (no occurrence counting, batching,
             invokes, grads, edits, errors or checks)
  interlace  `interlace.Model(...).trace(...)`
  hooks      a plain `register_forward_hook`

and prints each one's us over plain hooks and over the prototype. The difference between
`interlace` and `minimal` is what interlace's engine (intervention/) spends beyond a
bare mechanism; `minimal` over `prototype` is the tracer core's share plus the minimal
engine's few Python steps; `core` and `gencore` over their prototypes are the tracer core's
alone. The traces' saved tensors are checked equal to plain hooks' first.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class MinimalEngine:
    """One pooled greenlet runs the bodies; a module's forward is replaced while a body waits
    for it (made once per module, installed per run)."""

    def __init__(self, root):
        self.root = root
        self.worker = self.driver = self.waiting = self.locals = None
        self.forwards = {}  # module -> its replacement forward
        self.installed = []

    def wait(self, module):
        """Body side: the output of `module`'s next call."""
        if module not in self.installed:
            forward = self.forwards.get(module)
            if forward is None:
                forward = self.forwards[module] = self._forward(module)
            module.__dict__["forward"] = forward
            self.installed.append(module)
        self.waiting = module
        return self.driver.switch()

    def _forward(self, module):
        original = module.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.waiting is module:
                self.waiting = None
                self.worker.switch(out)
            return out
        return forward

    def _loop(self, job):
        while True:
            self.locals = job()
            job = self.driver.switch()

    def run(self, body, args):
        """Run the model on `args` with `body` (a zero-argument callable) beside it."""
        from greenlet import getcurrent, greenlet

        self.driver = getcurrent()
        if self.worker is None:
            self.worker = greenlet(self._loop)
        self.worker.switch(body.run)  # the body runs to its first wait (or its end)
        try:
            if self.waiting is not None:
                self.root(*args)
        finally:
            for module in self.installed:
                del module.__dict__["forward"]
            self.installed.clear()
        values, self.locals = self.locals, None
        return values


class MinimalEnvoy:
    """`.child`, `[i]` and `.output`: just enough Envoy for the body."""

    def __init__(self, engine, module):
        self._engine = engine
        self._module = module
        self._items = None

    def __getattr__(self, name):
        child = MinimalEnvoy(self._engine, getattr(self._module, name))
        self.__dict__[name] = child
        return child

    def __getitem__(self, i):
        if self._items is None:
            self._items = [MinimalEnvoy(self._engine, child) for child in self._module]
        return self._items[i]

    @property
    def output(self):
        return self._engine.wait(self._module)


def saved_by_hook(module, block, *args):
    """`block`'s output in `module(*args)`, taken by a plain forward hook registered and
    removed around the call (the reference every probe compares with)."""
    kept = []
    handle = block.register_forward_hook(lambda m, a, o: kept.append(o))
    try:
        module(*args)
    finally:
        handle.remove()
    return kept[0]


def setup():
    """The model, its inputs and the four ways of tracing it: name -> zero-argument callable."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    sys.path.insert(0, os.path.join(ROOT, "src"))
    sys.path.insert(0, ROOT)
    import interlace
    from benchmarks.prototype import Bare, GeneratorCore, GeneratorPrototype, Tap
    from interlace.tracing import Tracer

    torch.manual_seed(0)
    module = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                        bos_token_id=0, eos_token_id=0)).eval()
    ids = torch.randint(0, 1000, (1, 16))
    model = interlace.Model(module)
    engine = MinimalEngine(module)
    root = MinimalEnvoy(engine, module)

    class _Backend:
        def __call__(self, tracer):
            tracer.push_result(engine.run(tracer.defer(), tracer.args))

    backend = _Backend()

    class MinimalTracer(Tracer):
        def __init__(self, *args):
            super().__init__(*args, backend=backend)

    block = module.transformer.h[0]
    tap = Tap()

    def interlace_trace():
        with model.trace(ids):
            out = model.transformer.h[0].output.save()
        return out

    def minimal_trace():
        with MinimalTracer(ids):
            out = root.transformer.h[0].output.save()
        return out

    def hooks():
        return saved_by_hook(module, block, ids)

    def prototype():
        return tap.run([block], lambda: tap.wait(block), lambda: module(ids))

    # The tracer core alone on each prototype: the `with` captured and skipped, the body
    # deferred, run, its saved names written back; its one read is the prototype's own.
    class _CoreBackend:
        def __call__(self, tracer):
            tracer.push_result(tap.run([block], tracer.defer().run, lambda: module(*tracer.args)))

    class CoreTracer(Tracer):
        def __init__(self, *args):
            super().__init__(*args, backend=_CoreBackend())

    def core_trace():
        with CoreTracer(ids):
            out = interlace.save(tap.wait(block))
        return out

    bare = Bare(module, ids, block)
    genproto = GeneratorPrototype().save_one(bare)
    gencore_trace = GeneratorCore().save_one(bare)  # (the harness's gencore)

    return {"hooks": hooks, "prototype": prototype, "genproto": genproto, "core": core_trace,
            "gencore": gencore_trace, "minimal": minimal_trace, "interlace": interlace_trace}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    ways = setup()
    with torch.no_grad():
        expected = ways["hooks"]()
        for name in ("core", "gencore", "minimal", "interlace"):
            got = ways[name]()
            if not torch.equal(got[0] if isinstance(got, tuple) else got, expected[0]
                               if isinstance(expected, tuple) else expected):
                sys.exit(f"{name}'s saved value differs from plain hooks'")
        for fn in ways.values():
            for _ in range(50):
                fn()
        times = {name: [] for name in ways}
        order = list(ways.items())
        for _ in range(args.rounds):
            random.shuffle(order)  # (no way always runs after the same other)
            for name, fn in order:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(f"tiny GPT-2, save layer 0's output, one thread, {args.rounds} interleaved rounds, medians\n")
    print("| way | us per trace | over plain hooks | over the prototype |")
    print("|---|---:|---:|---:|")
    for name, value in median.items():
        print(f"| {name} | {value:,.1f} | {value - median['hooks']:+.1f} | "
              f"{value - median['prototype']:+.1f} |")


if __name__ == "__main__":
    main()
