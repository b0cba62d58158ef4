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

import functools

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


# ---- the checked engine: the express run's mechanism with the checks it cannot do without ----


class Fallback(Exception):
    """What the checked engine would hand to a general run (the harness's bodies never do)."""


_OWN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")

#: The parts of an express run's read that `CheckedEngine` makes (all, unless told fewer): the
#: read asked in the body's own frame; the checks before a module is wrapped (the order, global
#: hooks, the module's own hooks and forward, its class); the called modules containing the read
#: one wrapped too (so that a container's output asked for from inside it can be served); the
#: body's own contextvars context and grad mode across each switch.
PARTS = frozenset({"frame", "checks", "containers", "context"})


class _Here:
    """`context.run` for a run without a context of its own: in the caller's."""

    @staticmethod
    def run(fn, *args):
        return fn(*args)


class CheckedEngine:
    """The generator route's mechanism with an express run's checks, in plain Python (about what
    `intervention/express.py` makes per trace, none of its occurrence counting, batching,
    invokes or hand-over): the body a generator (each read a `yield` of its module, a write
    the replacement of the value being served), a module's instance `forward` replaced when
    the body first asks for it, after the checks that make that safe. The floor of that
    mechanism, written as plainly as it can be (benchmarks/probes/engine_floor.py prices it
    part by part: `parts`, of PARTS)."""

    def __init__(self, root, example, parts=PARTS):
        import contextvars
        import sys
        import threading

        from torch.nn.modules import module as torch_module

        from interlace.tracing.save import enter_body, exit_body

        self.parts = frozenset(parts)
        self.root = root
        self.lock = threading.Lock()
        self.get_ident, self.copy_context = threading.get_ident, contextvars.copy_context
        self.enter_body, self.exit_body = enter_body, exit_body
        self.getframe = sys._getframe
        self.owner = None  # the thread running the model (interlace's engine keeps it to refuse others)
        self.is_grad_enabled, self.set_grad_enabled = torch.is_grad_enabled, torch.set_grad_enabled
        self.global_hooks = (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks,
                             torch_module._global_backward_hooks)
        self.forwards = {}  # module -> its wrapper, made once
        self.positions = {}  # module -> its place in the learned order (its first call)
        self.classes = {}  # module -> (its class, the class's forward) when learned
        self.ancestors = {}  # module -> the modules containing it (not the root)
        self.installed = []
        self.gen = self.context = self.waiting = self.serving = self.new = self.values = None
        self.position, self.body_grad = -1, True
        self._learn(example)

    def _learn(self, example):
        """The order of the modules' calls in a forward on `example` (the learned order), and
        which modules contain which."""
        order = []
        handles = [m.register_forward_pre_hook(lambda m, a: order.append(m)) for m in self.root.modules()]
        try:
            with torch.no_grad():
                self.root(*example)
        finally:
            for handle in handles:
                handle.remove()
        for module in order:
            self.positions.setdefault(module, len(self.positions))
        parents = {}
        for parent in self.root.modules():
            for child in parent.children():
                parents[child] = parent
        for module in self.root.modules():
            self.classes[module] = (type(module), type(module).forward)
            chain, up = [], parents.get(module)
            while up is not None and up is not self.root:
                chain.append(up)
                up = parents.get(up)
            self.ancestors[module] = tuple(chain)

    def ask(self, module):
        """Body side, before a read yields (from `CheckedEnvoy.__interlace_read__`, called by
        the reading frame): may this run serve `module`'s output? (Its wrappers set.) Raises
        Fallback where an express run would hand over."""
        parts = self.parts
        if "frame" in parts and self.getframe(2) is not self.gen.gi_frame:
            raise Fallback("read outside the body's frame")
        checks = "checks" in parts
        if checks:
            place = self.positions.get(module)
            if place is None or place <= self.position:
                raise Fallback("out of order")
        if module in self.installed:
            return
        if checks and any(self.global_hooks):
            raise Fallback("global hooks")
        for m in (module, *self.ancestors[module]) if "containers" in parts else (module,):
            if m in self.installed or (m is not module and m not in self.positions):
                continue  # (set already, or a container never called: a ModuleList)
            instance = m.__dict__
            if checks:
                if "forward" in instance or any(map(instance.get, _OWN_HOOKS)):
                    raise Fallback("a forward or hooks of its own")
                cls, forward = self.classes[m]
                if type(m) is not cls or cls.forward is not forward:
                    raise Fallback("its class changed")
            wrapper = self.forwards.get(m)
            if wrapper is None:
                wrapper = self.forwards[m] = self._forward(m)
            instance["forward"] = wrapper
            self.installed.append(m)

    def write(self, module, value):
        """Body side: `value` replaces the output being served (only that one)."""
        if module is not self.serving:
            raise Fallback("a write to a value not being served")
        self.new = value

    def _forward(self, module):
        original = module.forward
        place = self.positions[module]

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            if self.waiting is not module:
                return out
            self.position, self.serving = place, module
            if self.context is None:  # (no context of its own: plain sends)
                try:
                    self.waiting = self.gen.send(out)
                except StopIteration as end:
                    self.waiting, self.values = None, end.value
            else:
                model_grad = self.is_grad_enabled()
                if model_grad != self.body_grad:
                    self.set_grad_enabled(self.body_grad)
                try:
                    self.waiting = self.context.run(self.gen.send, out)
                except StopIteration as end:
                    self.waiting, self.values = None, end.value
                finally:
                    self.body_grad = self.is_grad_enabled()
                    if self.body_grad != model_grad:
                        self.set_grad_enabled(model_grad)
            self.serving = None
            new, self.new = self.new, None
            return out if new is None else new
        return forward

    def run(self, body, args):
        """Run the model on `args` with `body` (a deferred body) beside it: its final locals."""
        if not self.lock.acquire(False):
            raise Fallback("another run has the model")
        self.owner = self.get_ident()
        gen = self.gen = body.generator()
        context = self.context = self.copy_context() if "context" in self.parts else None
        runner = _Here if context is None else context  # (a Context with no variables is falsy)
        token = runner.run(self.enter_body, body.state)
        self.position, self.body_grad, self.values = -1, self.is_grad_enabled(), None
        try:
            try:
                self.waiting = runner.run(gen.send, None)
            except StopIteration as end:
                self.waiting, self.values = None, end.value
            self.root(*args)
        finally:
            for module in self.installed:
                del module.__dict__["forward"]
            self.installed.clear()
            if self.waiting is not None:
                self.waiting = None
                gen.close()
            runner.run(self.exit_body, token)
            self.gen = self.context = None
            self.owner = None
            self.lock.release()
        values, self.values = self.values, None
        if values is None:
            raise Fallback("the body waited for a module the forward did not call")
        return body.generator_locals(values)


class ProbeEnvoy:
    """`.child` and `[i]`: just enough Envoy for a body to find its module (the children made
    once, of the same class); a subclass says how `.output` is read."""

    def __init__(self, engine, module):
        self._engine = engine
        self._module = module
        self._items = None

    def __getattr__(self, name):
        child = type(self)(self._engine, getattr(self._module, name))
        self.__dict__[name] = child
        return child

    def __getitem__(self, i):
        if self._items is None:
            self._items = [type(self)(self._engine, child) for child in self._module]
        return self._items[i]


class CheckedEnvoy(ProbeEnvoy):
    """`.output` (read and written) as the generator route reads it: the engine's checks, then
    one `yield`."""

    def __interlace_read__(self, name):
        self._engine.ask(self._module)
        return (yield self._module)

    def __interlace_write__(self, name, value):
        self._engine.write(self._module, value)
        return
        yield  # (a generator that returns at once: `yield from` it is the write)


def tracer_for(engine):
    """A `Tracer` class whose traces run their deferred body by `engine.run(body, args)` (the
    body's final locals) with interlace's real tracer core around it."""
    from interlace.tracing import Tracer

    class _Backend:
        def __call__(self, tracer):
            tracer.push_result(engine.run(tracer.defer(), tracer.args))

    backend = _Backend()

    class EngineTracer(Tracer):
        def __init__(self, *args):
            super().__init__(*args, backend=backend)

    return EngineTracer


class GeneratorChecked(Contender):
    """Interlace's tracer core driving the `CheckedEngine`: the floor of the express run's
    mechanism with the checks it cannot do without (issue 20's save-one bounds read against
    it). Only when named (`--contenders ...,checked`): every contender's lines raise the
    others' figures."""

    name, label = "checked", "tracer core + checked generator engine (prototype)"

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one engine per subject, for the process
    def _tracer(self, s):
        engine = CheckedEngine(s.module, (s.ids,))
        return tracer_for(engine), CheckedEnvoy(engine, s.module)

    def save_one(self, s):
        from interlace import save

        (Tracer, root), ids = self._tracer(s), s.ids

        def run():
            with Tracer(ids):
                h = save(s.layers_of(root)[0].output)
            return _first(h)
        return run

    def zero_mlps(self, s, k=None):
        from interlace import save

        (Tracer, root), ids = self._tracer(s), s.ids
        k = s.shape.layers if k is None else k

        def run():
            with Tracer(ids):
                layers = s.layers_of(root)
                for i in range(k):
                    mlp = layers[i].mlp
                    mlp.output = torch.zeros_like(mlp.output)
                logits = save(s.head_of(root).output)
            return logits
        return run

    def fixed(self, s):
        from interlace import save

        (Tracer, root), x = self._tracer(s), s.ids

        def run():
            with Tracer(x):
                h = save(root.output)
            return h
        return run
