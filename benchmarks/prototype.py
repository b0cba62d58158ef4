"""The `prototype` contender: issue 20's tapped, pooled greenlet, written by hand without interlace.

The mechanism issue 20 measured to tie plain hooks: each module the body reads or edits has
its instance `forward` replaced (in its `__dict__`) by a closure that calls the original
forward and, when the body waits for this module, switches to the body's greenlet, handing it
the output; the body runs on until it waits for the next module (or ends) and hands back a
replacement, if it made one. One greenlet, started once at top level, runs every body: it is
reused across traces, never made per trace. The closures are installed and removed around
each run, as plain hooks are registered and removed. The bodies are plain Python functions,
one per workload, doing the same reads and edits as the other contenders. Nothing else an
engine does (envoys, a deferred body, checks) is there: it is what a greenlet engine's
mechanism costs, for interlace's own steps to be measured against.
"""

from __future__ import annotations

import greenlet
import torch

from .contenders import Contender, _first, patching
from .probes import sweep as P


class Tap:
    """The pooled body greenlet and the closures that hand it module outputs."""

    def __init__(self):
        self.body = self.driver = self.waiting = self.new = self.result = self.error = None
        self.closures = {}  # module -> its closure, made once, installed per run

    def wait(self, module):
        """In a body: the output of `module`'s next call."""
        self.waiting, new, self.new = module, self.new, None
        return self.driver.switch(new)  # (hands back the replacement for the last output)

    def replace(self, value):
        """In a body: `value` replaces the output `wait` returned last."""
        self.new = value

    def _loop(self, job):
        while True:  # one job (a body) per run, on this one greenlet
            try:
                self.result, self.error = job(), None
            except Exception as error:  # noqa: BLE001 - raised in the driver
                self.result, self.error = None, error
            self.waiting, new, self.new = None, self.new, None
            job = self.driver.switch(new)

    def closure(self, module):
        original = module.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.waiting is module:
                new = self.body.switch(out)
                if new is not None:
                    out = new
            return out
        return forward

    def run(self, modules, body, call):
        """`call()` (the forward) with `modules` tapped and `body` run beside it: its result."""
        if self.body is None:
            self.body = greenlet.greenlet(self._loop)
        self.driver = greenlet.getcurrent()
        for m in modules:
            if m not in self.closures:
                self.closures[m] = self.closure(m)
            m.__dict__["forward"] = self.closures[m]
        try:
            self.body.switch(body)  # the body runs up to its first wait
            call()
        finally:
            for m in modules:
                del m.__dict__["forward"]
            if self.waiting is not None:  # left mid-body (the forward raised): a fresh greenlet
                self.body = self.waiting = None
                raise RuntimeError("the body waited for a module the forward did not call")
        if self.error is not None:
            raise self.error
        return self.result


class Prototype(Contender):
    name, label = "prototype", "tapped greenlet (prototype)"

    def __init__(self):
        self.tap = Tap()

    def save_one(self, s):
        module, ids, layer, tap = s.module, s.ids, s.layers()[0], self.tap
        return lambda: tap.run([layer], lambda: _first(tap.wait(layer)), lambda: module(ids))

    def save_all(self, s):
        module, ids, layers, tap = s.module, s.ids, list(s.layers()), self.tap
        return lambda: tap.run(layers, lambda: [_first(tap.wait(layer)) for layer in layers], lambda: module(ids))

    def zero_mlps(self, s, k=None):
        module, ids, head, tap = s.module, s.ids, s.lm_head(), self.tap
        mlps = [layer.mlp for layer in s.layers()][:k]

        def body():
            for mlp in mlps:
                tap.replace(torch.zeros_like(tap.wait(mlp)))
            return tap.wait(head)
        return lambda: tap.run(mlps + [head], body, lambda: module(ids))

    def fixed(self, s):
        module, x, tap = s.module, s.ids, self.tap
        return lambda: tap.run([module], lambda: tap.wait(module), lambda: module(x))

    def invokes(self, s, n):  # as plain hooks: one batch of n rows
        module, layer, batch, tap = s.module, s.layers()[0], torch.cat(s.rows(n)), self.tap
        return lambda: tap.run([layer], lambda: list(_first(tap.wait(layer)).split(1)), lambda: module(batch))

    def sweep_item(self, s, repeat, batch):
        """Per batch of items, one body: each layer's rows patched in a Python loop (as the
        floor's hooks do), the logit difference computed batched."""
        module, blocks, head, tap = s.module, list(s.layers()), s.lm_head(), self.tap
        clean, corrupt, items = patching(s, repeat)

        def run():
            out = []
            for start in range(0, len(items), batch):
                chunk = items[start:start + batch]
                routes = P.routes(chunk)
                tapped = [blocks[layer] for layer in sorted(routes)]

                def body(routes=routes):
                    for layer in sorted(routes):
                        P.write_rows(_first(tap.wait(blocks[layer])), clean[layer], routes[layer])
                    logits = tap.wait(head)[:, -1]
                    return logits[:, P.A] - logits[:, P.B]
                out.append(tap.run(tapped + [head], body, lambda: module(corrupt.expand(len(chunk), -1))))
            return torch.cat(out)
        return run


class GenTap:
    """Issue 21's mechanism by hand: the body is a Python generator that yields the module it
    waits for and receives its output; each tapped forward `send`s the output in. No greenlet,
    no engine: what the generator route's reads cost at their floor."""

    def __init__(self):
        self.gen = self.waiting = self.new = self.result = None
        self.closures = {}

    def closure(self, module):
        original = module.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.waiting is module:
                try:
                    self.waiting = self.gen.send(out)
                except StopIteration as end:
                    self.waiting, self.result = None, end.value
                new, self.new = self.new, None
                if new is not None:
                    out = new
            return out
        return forward

    def run(self, modules, body, call):
        """`call()` with `modules` tapped and generator function `body` run beside it."""
        for m in modules:
            if m not in self.closures:
                self.closures[m] = self.closure(m)
            m.__dict__["forward"] = self.closures[m]
        gen = self.gen = body()
        try:
            self.waiting = next(gen)  # the body runs up to its first wait
            call()
        finally:
            for m in modules:
                del m.__dict__["forward"]
            self.gen = None
            if self.waiting is not None:
                self.waiting = None
                gen.close()
                raise RuntimeError("the body waited for a module the forward did not call")
        result, self.result = self.result, None
        return result


def _row(output, row):
    """Row `row` of a module's output (a view of each tensor in it): an invoke's own value."""
    if isinstance(output, tuple):
        return tuple(_row(part, row) for part in output)
    return output[row:row + 1] if isinstance(output, torch.Tensor) else output


class GeneratorPrototype(Contender):
    name, label = "genproto", "generator body (prototype)"

    def __init__(self):
        self.tap = GenTap()

    def save_one(self, s):
        module, ids, layer, tap = s.module, s.ids, s.layers()[0], self.tap

        def body():
            return _first((yield layer))
        return lambda: tap.run([layer], body, lambda: module(ids))

    def zero_mlps(self, s, k=None):
        module, ids, head, tap = s.module, s.ids, s.lm_head(), self.tap
        mlps = [layer.mlp for layer in s.layers()][:k]

        def body():
            for mlp in mlps:
                tap.new = torch.zeros_like((yield mlp))
            return (yield head)
        return lambda: tap.run(mlps + [head], body, lambda: module(ids))

    def fixed(self, s):
        module, x, tap = s.module, s.ids, self.tap

        def body():
            return (yield module)
        return lambda: tap.run([module], body, lambda: module(x))

    def invokes(self, s, n):
        """n invokes as an express run of several generator bodies would run them, with no
        engine: the rows stacked into one batch per call, with the mask of ones and the
        positions a language model's batch carries (as interlace's batcher makes them); one
        generator body per invoke, each sent its own row of the block's output (a view per
        tensor) and saving it. The floor of that route, against plain hooks' one batch."""
        module, layer, rows = s.module, s.layers()[0], s.rows(n)

        def body(saved):
            saved.append((yield layer))

        def run():
            saved = []
            bodies = [body(saved) for _ in rows]
            for gen in bodies:
                next(gen)

            def serve(m, args, output):
                for row, gen in enumerate(bodies):
                    try:
                        gen.send(_row(output, row))
                    except StopIteration:
                        pass
            ids = torch.cat(rows)
            mask = torch.ones_like(ids)
            handle = layer.register_forward_hook(serve)
            try:
                module(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1).sub_(1))
            finally:
                handle.remove()
            return [_first(h) for h in saved]
        return run

    def sweep_item(self, s, repeat, batch):
        """A sweep as the generator route would run it with no engine: per item, the sweep's
        body as a generator that yields the module it waits for and gets its own row; one
        forward hook per patched block and one on the unembedding send each waiting item,
        in batch order, its row of the output. The body's own torch ops run per item, as
        interlace's do (the floor's run batched)."""
        module, blocks, head = s.module, list(s.layers()), s.lm_head()
        clean, corrupt, items = patching(s, repeat)

        def body(item):
            layer, pos = item
            (yield blocks[layer])[:, pos] = clean[layer][:, pos]
            logits = (yield head)[:, -1]
            return logits[:, P.A] - logits[:, P.B]

        def run():
            out = []
            for start in range(0, len(items), batch):
                chunk = items[start:start + batch]
                waiting = {m: [] for m in blocks + [head]}
                done = [None] * len(chunk)
                for row, item in enumerate(chunk):
                    gen = body(item)
                    waiting[next(gen)].append((row, gen))

                def serve(m, args, output):
                    ready, waiting[m] = waiting[m], []
                    for row, gen in ready:
                        try:
                            waiting[gen.send(output[row:row + 1])].append((row, gen))
                        except StopIteration as end:
                            done[row] = end.value
                handles = [m.register_forward_hook(serve) for m in waiting]
                try:
                    module(corrupt.expand(len(chunk), -1))
                finally:
                    for handle in handles:
                        handle.remove()
                out.extend(done)
            return torch.cat(out)
        return run


class _Read:
    """`.output` of one module for a generator body compiled by interlace's tracer core
    (tracing/generators.py): a read is one `yield` of the module, answered by the GenTap's
    `send`; a write hands the GenTap the replacement."""

    def __init__(self, tap, module):
        self.tap = tap
        self.module = module

    def __interlace_read__(self, name):
        return (yield self.module)

    def __interlace_write__(self, name, value):
        self.tap.new = value
        return
        yield  # (a generator that returns at once: `yield from` it is the write)


class GeneratorCore(Contender):
    """Interlace's tracer core around the generator prototype: the `with` block captured and
    skipped, its body deferred with the caller's names bound and compiled as a generator (its
    reads `yield`s), run by the GenTap, its saved names written back into the caller. No
    engine (envoys, occurrences, batching, checks): what the capture-and-skip design costs
    with the generator mechanism, the floor interlace's engine is measured against."""

    name, label = "gencore", "tracer core + generator body (prototype)"

    def __init__(self):
        from interlace.tracing import Tracer
        from interlace.tracing.save import enter_body, exit_body

        tap = self.tap = GenTap()

        class _Backend:
            def __call__(self, tracer):
                body = tracer.defer()
                token = enter_body(body.state)  # `.save()` saves into this trace
                try:
                    values = tap.run(tracer.modules, body.generator, tracer.call)
                finally:
                    exit_body(token)
                tracer.push_result(body.generator_locals(values))

        backend = _Backend()

        class CoreTracer(Tracer):
            def __init__(self, modules, call):
                super().__init__(backend=backend)
                self.modules = modules
                self.call = call

        self.Tracer = CoreTracer

    def save_one(self, s):
        from interlace import save

        module, ids, layer, Tracer = s.module, s.ids, s.layers()[0], self.Tracer
        read = _Read(self.tap, layer)

        def run():
            with Tracer([layer], lambda: module(ids)):
                h = save(read.output)
            return _first(h)
        return run

    def zero_mlps(self, s, k=None):
        from interlace import save

        module, ids, head, Tracer = s.module, s.ids, s.lm_head(), self.Tracer
        mlps = [layer.mlp for layer in s.layers()][:k]
        reads, logits = [_Read(self.tap, mlp) for mlp in mlps], _Read(self.tap, head)

        def run():
            with Tracer(mlps + [head], lambda: module(ids)):
                for mlp in reads:
                    mlp.output = torch.zeros_like(mlp.output)
                out = save(logits.output)
            return out
        return run

    def fixed(self, s):
        from interlace import save

        module, x, Tracer = s.module, s.ids, self.Tracer
        read = _Read(self.tap, module)

        def run():
            with Tracer([module], lambda: module(x)):
                h = save(read.output)
            return h
        return run


class Bare:
    """A subject for the probes (`probes/steps.py`, `probes/engine_floor.py`): `module`, its
    input `ids` and the one `block` whose output a save-one body reads (`layers()[0]`), so that
    they time the contenders' own `save_one` rather than copies of it."""

    def __init__(self, module, ids, block):
        self.module, self.ids, self.block = module, ids, block

    def layers(self):
        return [self.block]
