"""What a trace costs with interlace's tracer core and a minimal engine: where issue 20's gap is.

    python benchmarks/probes/engine_floor.py              # tiny GPT-2, save layer 0's output
    python benchmarks/probes/engine_floor.py --rounds 2000 --ways prototype,gencore,checked,interlace
    python benchmarks/probes/engine_floor.py --ways checked,checked-containers,checked-all

Issue 20 asks for a save-one trace within +20 us of the prototype contender (a tapped, pooled
greenlet written by hand, `benchmarks/prototype.py`). Before concluding which part of
interlace stands in the way, this isolates it: the same `with` block run several ways (`--ways`;
plain hooks always), in shuffled order round by round in one process (medians):

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
  checked    interlace's real tracer core driving a generator engine written here in plain
             Python that makes what an express run must make before and while it serves a
             read (`CheckedEngine`, PARTS): the engine's lock and owner; the read asked in
             the body's own frame ("frame"); the order, global hooks, and each wrapped
             module's own hooks, forward and class checked ("checks"); the called modules
             containing the read one wrapped too ("containers"); the body's own contextvars
             context and grad mode across each switch ("context"); Envoy-like objects with
             `.output`. No occurrence counting, batching, invokes, edits or hand-over: the
             floor of the express run's mechanism, in the plainest code
  checked-P  the same without part P (checked-all: without any), to price each part
  checked-fetched  `checked` with the Envoy chain looked up before the block
  interlace  `interlace.Model(...).trace(...)`; interlace-fetched: the Envoy looked up before
  hooks      a plain `register_forward_hook`

and prints each one's us over plain hooks and over the prototype. The difference between
`interlace` and `checked` is what interlace's engine (intervention/) spends beyond the same
mechanism with the checks it cannot do without, and `checked` over `gencore` what those
checks, containers and contexts cost; `minimal` over `prototype` is the tracer core's share
plus a bare engine's few Python steps; `core` and `gencore` over their prototypes are the
tracer core's alone. The traces' saved tensors are checked equal to plain hooks' first.

Every way's code and objects are cache lines the others' calls must fetch again: the more
ways in one shuffle, the higher every figure, the largest footprint's most (interlace read
+26-29 us over the prototype with four other ways, +40-48 with nine). Compare ways within one
run, with the same `--ways`.
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
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # (this checkout's benchmarks package, run as a script)

from benchmarks.prototype import PARTS, CheckedEngine, CheckedEnvoy, ProbeEnvoy, tracer_for  # noqa: E402


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


class MinimalEnvoy(ProbeEnvoy):
    """`.output` read from the minimal engine: its greenlet waits for the module."""

    @property
    def output(self):
        return self._engine.wait(self._module)


WAYS = ("hooks", "prototype", "genproto", "core", "gencore", "minimal", "checked", "checked-checks",
        "checked-containers", "checked-context", "checked-frame", "checked-all", "checked-fetched",
        "interlace", "interlace-fetched")


def checked_trace(module, ids, parts=None, fetched=False):
    """A save-one trace of GPT-2 `module` on `ids` (block 0's output) by interlace's tracer core
    driving a CheckedEngine (benchmarks/prototype.py) making `parts` (all by default), with the
    Envoy chain looked up in the body (or before it when `fetched`): a zero-argument callable
    returning the saved value."""
    import interlace

    engine = CheckedEngine(module, (ids,), PARTS if parts is None else parts)
    root = CheckedEnvoy(engine, module)
    block_envoy = root.transformer.h[0]
    CheckedTracer = tracer_for(engine)

    if fetched:
        def trace():
            with CheckedTracer(ids):
                out = interlace.save(block_envoy.output)
            return out
    else:
        def trace():
            with CheckedTracer(ids):
                out = interlace.save(root.transformer.h[0].output)
            return out
    return trace


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
    MinimalTracer = tracer_for(engine)

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

    interlace_block = model.transformer.h[0]

    def interlace_fetched():
        with model.trace(ids):
            out = interlace_block.output.save()
        return out

    bare = Bare(module, ids, block)
    genproto = GeneratorPrototype().save_one(bare)
    gencore_trace = GeneratorCore().save_one(bare)  # (the harness's gencore)

    ways = {"hooks": hooks, "prototype": prototype, "genproto": genproto, "core": core_trace,
            "gencore": gencore_trace, "minimal": minimal_trace, "checked": checked_trace(module, ids),
            "interlace": interlace_trace}
    # the same, less one part each (what each costs), and with the Envoy chain looked up before
    for part in sorted(PARTS):
        ways[f"checked-{part}"] = checked_trace(module, ids, PARTS - {part})
    ways["checked-all"] = checked_trace(module, ids, frozenset())
    ways["checked-fetched"] = checked_trace(module, ids, fetched=True)
    ways["interlace-fetched"] = interlace_fetched
    return ways


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--ways", default="prototype,genproto,core,gencore,minimal,checked,interlace",
                        help="comma-separated, of " + ", ".join(WAYS) + " (plain hooks always run: "
                             "the reference); every way in one shuffle adds its lines to the others'")
    args = parser.parse_args()
    import torch

    wanted = ["hooks"] + [w for w in args.ways.split(",") if w and w != "hooks"]
    unknown = sorted(set(wanted) - set(WAYS))
    if unknown:
        parser.error(f"no such way: {', '.join(unknown)} (known: {', '.join(WAYS)})")
    torch.set_num_threads(1)
    every = setup()
    ways = {name: every[name] for name in wanted}
    with torch.no_grad():
        expected = ways["hooks"]()
        for name in ways:
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
    proto = median.get("prototype")
    print("| way | us per trace | over plain hooks | over the prototype |")
    print("|---|---:|---:|---:|")
    for name, value in median.items():
        print(f"| {name} | {value:,.1f} | {value - median['hooks']:+.1f} | "
              + ("—" if proto is None else f"{value - proto:+.1f}") + " |")


if __name__ == "__main__":
    main()
