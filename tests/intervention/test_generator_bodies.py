"""Bodies that run as generators (intervention/routes.py, tracing/generators.py).

A site's first run audits it on a greenlet; a site whose reads were all in its own lines
runs as a generator from then on. Either way every value must equal what plain torch hooks
on the same model see, and the one observable difference (a read that only a later run
makes in a helper) must be an error naming its line, raised before the read, after which
the site runs on greenlets.
"""

import contextvars
import os
import subprocess
import sys

import pytest
import torch

import interlace
from interlace.errors import InterlaceError
from interlace.intervention import routes
from interlace.intervention.mediator import AuditMediator, GeneratorMediator, Mediator
from interlace.tracing.blocks import BLOCKS

pytestmark = pytest.mark.skipif(not routes.ENABLED, reason="generator bodies are forced off (INTERLACE_GENERATORS=0: make test-greenlets)")


def _reference(gpt2, ids, zero_mlp1=False):
    """(h[0].mlp output, logits) by plain torch hooks."""
    seen = []
    handles = [gpt2.transformer.h[0].mlp.register_forward_hook(lambda m, a, o: seen.append(o.clone()))]
    if zero_mlp1:
        handles.append(gpt2.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: o * 0))
    try:
        with torch.no_grad():
            logits = gpt2(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen[0], logits


def _kind(model):
    """Inside a body: the class of the mediator running it."""
    return type(model._active().current).__name__


def test_a_site_is_audited_once_then_runs_as_a_generator_with_the_hooks_values(gpt2, gpt2_model, ids):
    model = gpt2_model
    mlp0, logits = _reference(gpt2, ids, zero_mlp1=True)
    kinds = []
    for _ in range(3):
        with torch.no_grad(), model.trace(ids):
            kind = interlace.save(_kind(model))
            h = model.transformer.h[0].mlp.output.save()
            model.transformer.h[1].mlp.output = model.transformer.h[1].mlp.output * 0
            out = model.lm_head.output.save()
        kinds.append(kind)
        assert torch.equal(h, mlp0) and torch.allclose(out, logits, atol=1e-6)
    assert kinds == ["AuditMediator", "GeneratorMediator", "GeneratorMediator"]


def test_inputs_input_and_result_are_served_to_a_generator_body(gpt2, gpt2_model, ids):
    model = gpt2_model
    for _ in range(3):
        with torch.no_grad(), model.trace(ids) as tracer:
            kind = interlace.save(_kind(model))
            first = model.transformer.h[1].input.save()
            args, kwargs = model.transformer.h[1].inputs
            same = interlace.save(args[0] is first)
            model.transformer.h[1].input = first * 2
            result = tracer.result.save()
        assert same
    assert kind == "GeneratorMediator"
    doubled = []
    handle = gpt2.transformer.h[1].register_forward_pre_hook(lambda m, a: (a[0] * 2, *a[1:]))
    try:
        with torch.no_grad():
            doubled = gpt2(ids).logits
    finally:
        handle.remove()
    assert torch.allclose(result.logits, doubled, atol=1e-6)


# -- the five shapes of user code that reads, called from a body ---------------------------

def read_mlp0(envoy):
    """A module-level function that takes an Envoy and reads its output."""
    return envoy.transformer.h[0].mlp.output


class Probe:
    def __init__(self, model):
        self.model = model

    def grab(self):
        return self.model.transformer.h[0].mlp.output

    def trace(self, ids):
        """A method whose trace body calls another method through `self.`."""
        with torch.no_grad(), self.model.trace(ids):
            kind = interlace.save(_kind(self.model))
            h = self.grab().save()
        return kind, h


class Lora:
    """A callable object whose `__call__` reads and writes (LoRA-style)."""

    def __init__(self, scale):
        self.scale = scale

    def __call__(self, envoy):
        envoy.output = envoy.output * self.scale


def read_all(layers):
    """A helper that reads in a loop."""
    return [layer.mlp.output for layer in layers]


def add_invoke(tracer, model, ids, saved):
    """A helper that opens its own invoke."""
    with tracer.invoke(ids):
        saved.append(model.transformer.h[0].mlp.output.save())


def test_a_body_that_calls_code_which_reads_stays_on_greenlets_and_is_right(gpt2, gpt2_model, ids):
    model = gpt2_model
    mlp0, logits = _reference(gpt2, ids)
    probe = Probe(model)
    lora = Lora(0.0)
    for _ in range(3):
        with torch.no_grad(), model.trace(ids):
            kind_a = interlace.save(_kind(model))
            a = read_mlp0(model).save()
        kind_b, b = probe.trace(ids)
        with torch.no_grad(), model.trace(ids):
            kind_c = interlace.save(_kind(model))
            lora(model.transformer.h[1].mlp)
            c = model.lm_head.output.save()
        with torch.no_grad(), model.trace(ids):
            kind_d = interlace.save(_kind(model))
            d = interlace.save(read_all(model.transformer.h))
        saved = []
        with torch.no_grad(), model.trace() as tracer:
            add_invoke(tracer, model, ids, saved)
        assert torch.equal(a, mlp0) and torch.equal(b, mlp0) and torch.equal(d[0], mlp0)
        assert torch.equal(saved[0], mlp0)
        assert torch.allclose(c, _reference(gpt2, ids, zero_mlp1=True)[1], atol=1e-6)
        assert (kind_a, kind_b, kind_c, kind_d) in {("AuditMediator",) * 4, ("Mediator",) * 4}
    assert (kind_a, kind_b, kind_c, kind_d) == ("Mediator",) * 4


def test_a_read_only_a_later_run_makes_in_a_helper_is_refused_at_its_line_then_served(gpt2, gpt2_model, ids):
    model = gpt2_model
    mlp0, _ = _reference(gpt2, ids)
    after_read = []

    def helper():
        value = model.transformer.h[0].mlp.output  # the stray read
        after_read.append(value)
        return value

    line = helper.__code__.co_firstlineno + 1
    kinds = []
    for flag in (False, False, True, True):
        try:
            with torch.no_grad(), model.trace(ids):
                kind = interlace.save(_kind(model))
                h = helper().save() if flag else model.transformer.h[0].mlp.output.save()
        except InterlaceError as error:
            kinds.append("refused")
            assert f"{__file__}:{line}" in str(error)
            assert "run it again" in str(error)
            assert after_read == []  # nothing after the read ran: it had no effect
            continue
        kinds.append(kind)
        assert torch.equal(h, mlp0)
    assert kinds == ["AuditMediator", "GeneratorMediator", "refused", "Mediator"]
    assert len(after_read) == 1


def test_a_body_that_waits_in_ways_only_greenlets_serve_never_takes_the_route(gpt2_model, ids):
    model = gpt2_model
    for _ in range(2):
        with torch.no_grad(), model.trace(ids) as tracer:
            kind = interlace.save(_kind(model))
            model.transformer.h[0].mlp.output.save()
            tracer.stop()
        assert kind == "Mediator"
        with torch.no_grad(), model.trace(ids):
            kind = interlace.save(_kind(model))
            outs = interlace.save(list(layer.output[0] for layer in model.transformer.h))
        assert kind == "Mediator" and len(outs) == 2
        for i in range(2):
            with torch.no_grad(), model.trace(ids) as tracer:
                kind = interlace.save(_kind(model))
                for step in tracer.iter[0:1]:
                    h = model.transformer.h[i].output[0].save()
            assert kind == "Mediator" and h.shape[-1] == 64


def test_a_comprehension_that_reads_runs_as_a_loop_of_the_generator_body(gpt2, gpt2_model, ids):
    model = gpt2_model
    expected = []
    handles = [layer.register_forward_hook(lambda m, a, o: expected.append(o[0].clone()))
               for layer in gpt2.transformer.h]
    try:
        with torch.no_grad():
            gpt2(ids)
    finally:
        for handle in handles:
            handle.remove()
    for _ in range(3):
        with torch.no_grad(), model.trace(ids):
            kind = interlace.save(_kind(model))
            outs = interlace.save([layer.output[0] for layer in model.transformer.h])
            norms = interlace.save({i: layer.output[0].norm() for i, layer in enumerate(model.transformer.h) if i})
        assert all(torch.equal(a, b) for a, b in zip(outs, expected))
        assert list(norms) == [1] and torch.equal(norms[1], expected[1].norm())
    assert kind == "GeneratorMediator"


def test_a_generator_body_has_its_own_contextvars_and_grad_mode_across_its_waits(gpt2_model, ids):
    model = gpt2_model
    var = contextvars.ContextVar("var", default="caller")
    var.set("caller")
    for _ in range(3):
        with model.trace(ids):
            kind = interlace.save(_kind(model))
            seen_at_start = interlace.save(var.get())
            var.set("body")
            torch.set_grad_enabled(False)
            h = model.transformer.h[0].output[0]
            body_grad = interlace.save(torch.is_grad_enabled())
            body_var = interlace.save(var.get())
            later = model.transformer.h[1].output[0]
            model_grad = interlace.save(later.requires_grad)
            h.save()
        assert var.get() == "caller" and torch.is_grad_enabled()
        assert seen_at_start == "caller" and body_var == "body"
        assert body_grad is False and model_grad is True  # the forward kept its own mode
    assert kind == "GeneratorMediator"


def test_an_error_in_a_generator_body_keeps_its_type_and_shows_only_user_frames(gpt2_model, ids):
    model = gpt2_model
    kinds = []
    for fail in (False, True, True):
        try:
            with torch.no_grad(), model.trace(ids):
                kinds.append(_kind(model))
                h = model.transformer.h[0].mlp.output
                if fail:
                    torch.mm(h[0], torch.ones(3, 3))  # shapes cannot be multiplied
        except RuntimeError as error:
            ours = [tb.tb_frame.f_code.co_name for tb in _frames(error.__traceback__)
                    if tb.tb_frame.f_code.co_filename != __file__]
            # natively no interlace frame; the twin keeps the one `__exit__` that re-raises
            assert ours == ([] if interlace.native else ["__exit__"]), ours
            assert "mat1 and mat2" in str(error)
        else:
            assert not fail
    assert kinds == ["AuditMediator", "GeneratorMediator", "GeneratorMediator"]


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_a_trace_of_another_model_opened_by_a_helper_inside_a_generator_body(gpt2_model, mlp_model, ids, x6):
    def inner():
        with torch.no_grad(), mlp_model.trace(x6):
            out = mlp_model[0].output.save()
        return out

    expected = mlp_model._module[0](x6)
    for _ in range(3):
        with torch.no_grad(), gpt2_model.trace(ids):
            kind = interlace.save(_kind(gpt2_model))
            h = gpt2_model.transformer.h[0].output[0]
            nested = interlace.save(inner())
            h.save()
        assert torch.allclose(nested, expected)
    assert kind == "GeneratorMediator"


def test_sweep_items_run_as_generators_and_equal_one_trace_each(gpt2_model, ids):
    model = gpt2_model
    items = [(layer, pos) for layer in range(2) for pos in range(4)]
    for _ in range(2):
        with torch.no_grad(), model.sweep(items, input=ids[:1], batch_size=4, progress=False) as sweep:
            kind = interlace.save(_kind(model))
            layer, pos = sweep.item
            model.transformer.h[layer].output[0][:, pos] = 0
            logits = sweep.output.logits[:, -1].save()
    assert set(kind) == {"GeneratorMediator"}
    for (layer, pos), value in zip(items, logits):
        with torch.no_grad(), model.trace(ids[:1]):
            model.transformer.h[layer].output[0][:, pos] = 0
            alone = model.lm_head.output[:, -1].save()
        assert torch.equal(value, alone)


def test_a_tracer_that_builds_its_own_bodies_keeps_greenlets_unless_it_opts_in():
    from types import SimpleNamespace

    from interlace.tracing import Tracer

    class OwnBuild(Tracer):
        def build(self, node):
            return super().build(node)

    class OptedIn(OwnBuild):
        generator_bodies = True

    block = object()
    for cls, expected in ((Tracer, block), (OwnBuild, None), (OptedIn, block)):
        body = SimpleNamespace(globals={}, tracer=cls(), block=block)
        assert routes.eligible(body) is expected


def test_with_the_environment_switch_off_every_body_runs_on_greenlets():
    script = (
        "import torch, interlace\n"
        "model = interlace.Model(torch.nn.Sequential(torch.nn.Linear(2, 2)))\n"
        "for _ in range(3):\n"
        "    with model.trace(torch.ones(1, 2)):\n"
        "        kind = interlace.save(type(model._active().current).__name__)\n"
        "        model[0].output.save()\n"
        "    print(kind)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env["INTERLACE_GENERATORS"] = "0"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Mediator"] * 3
    env.pop("INTERLACE_GENERATORS")  # by default: audited, then a generator
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AuditMediator", "GeneratorMediator", "GeneratorMediator"]


def test_mediator_classes_are_the_engines_own():
    assert issubclass(GeneratorMediator, Mediator) and issubclass(AuditMediator, Mediator)
    assert BLOCKS is not None


def test_an_assignment_the_model_then_fails_on_is_named_at_its_line_in_a_generator_body(gpt2_model, ids):
    import inspect

    model = gpt2_model
    line = None
    kinds = []
    for width in (64, 64, 7):
        try:
            with torch.no_grad(), model.trace(ids):
                kinds.append(_kind(model))
                model.transformer.h[0].mlp.output = torch.zeros(2, 12, width)
        except RuntimeError as error:
            line = inspect.getsourcelines(test_an_assignment_the_model_then_fails_on_is_named_at_its_line_in_a_generator_body)
            start = line[1] + next(i for i, text in enumerate(line[0]) if "mlp.output = torch.zeros" in text)
            if sys.version_info >= (3, 11):  # (notes are 3.11+; an express run adds it too)
                assert error.__notes__ == [
                    f"interlace: the trace body set model.transformer.h.0.mlp.output at {__file__}:{start} "
                    f"before the model raised this; check the value assigned there"
                ]
    assert line is not None and kinds == ["AuditMediator", "GeneratorMediator", "GeneratorMediator"]


def test_module_level_and_class_body_sites_run_as_generators_too():
    script = (
        "import torch, interlace\n"
        "model = interlace.Model(torch.nn.Sequential(torch.nn.Linear(2, 2)))\n"
        "x = torch.ones(1, 2)\n"
        "expected = model._module(x)\n"
        "kinds = []\n"
        "for i in range(3):\n"
        "    with torch.no_grad(), model.trace(x):\n"
        "        kinds.append(type(model._active().current).__name__)\n"
        "        out = model[0].output.save()\n"
        "    assert torch.allclose(out, expected)\n"
        "class Holder:\n"
        "    for i in range(3):\n"
        "        with torch.no_grad(), model.trace(x):\n"
        "            kinds.append(type(model._active().current).__name__)\n"
        "            y = model[0].output.save()\n"
        "assert torch.allclose(Holder.y, expected)\n"
        "print(' '.join(kinds))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("INTERLACE_GENERATORS", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AuditMediator", "GeneratorMediator", "GeneratorMediator"] * 2


def test_a_generator_body_traced_in_another_thread(gpt2, gpt2_model, ids):
    import threading

    mlp0, _ = _reference(gpt2, ids)
    out = {}

    def work():
        kinds, values = [], []
        for _ in range(3):
            with torch.no_grad(), gpt2_model.trace(ids):
                kinds.append(_kind(gpt2_model))
                values.append(gpt2_model.transformer.h[0].mlp.output.save())
        out["kinds"], out["values"] = kinds, values

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert out["kinds"] == ["AuditMediator", "GeneratorMediator", "GeneratorMediator"]
    assert all(torch.equal(v, mlp0) for v in out["values"])


def test_a_trace_run_inside_the_forward_while_a_generator_body_waits(mlp_model, x6):
    """Re-entrancy: the traced model's forward traces another model (whose body is a
    generator too) while the outer generator body waits for a later value."""
    inner_model = mlp_model

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(6, 6)
            self.last = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.first(x)
            with torch.no_grad(), inner_model.trace(h):
                inner = inner_model[0].output.save()
            self.seen = inner
            return self.last(inner_model._module(h))

    torch.manual_seed(0)
    outer_module = Outer().eval()
    outer = interlace.Model(outer_module)
    kinds = []
    for _ in range(3):
        with torch.no_grad(), outer.trace(x6):
            kinds.append(_kind(outer))
            first = outer.first.output.save()
            last = outer.last.output.save()
        assert torch.allclose(outer_module.seen, inner_model._module[0](first))
        assert torch.allclose(last, outer_module(x6))
    assert kinds == ["AuditMediator", "GeneratorMediator", "GeneratorMediator"]


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x * 2, x + 1


class _Mapping(torch.nn.Module):
    def forward(self, x):
        return {"out": x - 3}


class _Outputs(torch.nn.Module):
    """Children whose outputs are a tuple, a tensor and a dict: what a read returns as
    `yield from`'s value (natively the compiled read iterator's StopIteration)."""

    def __init__(self):
        super().__init__()
        self.pair = _Pair()
        self.plain = torch.nn.Linear(3, 3)
        self.mapping = _Mapping()

    def forward(self, x):
        a, b = self.pair(x)
        return self.mapping(self.plain(a + b))["out"]


def test_a_sweep_items_reads_return_tuples_tensors_and_dicts_as_hooks_see_them():
    torch.manual_seed(0)
    net = _Outputs()
    x = torch.randn(1, 3)
    seen = {}
    handles = [getattr(net, name).register_forward_hook(lambda m, a, o, name=name: seen.setdefault(name, o))
               for name in ("pair", "plain", "mapping")]
    try:
        with torch.no_grad():
            net(x)
    finally:
        for handle in handles:
            handle.remove()
    model = interlace.Model(net)
    for _ in range(2):  # the second run is the site's generator run
        with torch.no_grad(), model.sweep([0, 1, 2], input=x, batch_size=2, progress=False) as sweep:
            kind = interlace.save(_kind(model))
            pair = model.pair.output
            plain = model.plain.output
            mapping = model.mapping.output
            got = interlace.save((pair, plain, mapping))
    assert set(kind) == {"GeneratorMediator"}
    for pair, plain, mapping in got:
        assert type(pair) is tuple and len(pair) == 2
        assert torch.equal(pair[0], seen["pair"][0]) and torch.equal(pair[1], seen["pair"][1])
        assert torch.equal(plain, seen["plain"])
        assert set(mapping) == {"out"} and torch.equal(mapping["out"], seen["mapping"]["out"])


def test_an_envoys_attribute_named_like_a_read_is_the_modules_own_in_a_generator_body():
    """`envoy.result` is not a read for an Envoy (only `.output`/`.input`/`.inputs` are): a
    generator body gets the module's own attribute, as a greenlet body does, not its input."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.result = "the module's own attribute"

        def forward(self, x):
            return self.linear(x)

    net = torch.nn.Sequential(Scaled())
    model = interlace.Model(net)
    x = torch.randn(2, 3)
    kinds, seen = [], []
    for _ in range(3):
        with torch.no_grad(), model.trace(x):
            kind = interlace.save(_kind(model))
            got = interlace.save(model[0].result)
            out = model[0].output.save()
        kinds.append(kind)
        seen.append(got)
        assert torch.equal(out, net(x))
    assert kinds[-1] == "GeneratorMediator"
    assert seen == ["the module's own attribute"] * 3


def test_an_envoy_subclass_with_its_own_output_is_read_as_its_own_in_a_generator_body():
    """`.output` in a generator body is served by the compiled read only for an Envoy whose
    `output` is the Envoy's own property: a subclass's own `output` is read as it is, as a
    greenlet body reads it."""

    class Labelled(interlace.Envoy):
        @property
        def output(self):
            return "the subclass's own output"

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    model = interlace.Model(net, envoys={"0": Labelled})
    x = torch.randn(2, 3)
    kinds = []
    for _ in range(3):
        with torch.no_grad(), model.trace(x):
            kind = interlace.save(_kind(model))
            label = interlace.save(model[0].output)
            plain = model[1].output.save()
        kinds.append(kind)
        assert label == "the subclass's own output"
        with torch.no_grad():
            assert torch.equal(plain, net(x))
    assert kinds[-1] == "GeneratorMediator"


def test_invokes_that_share_no_variable_run_as_generators_and_equal_each_row_alone(gpt2, gpt2_model, ids):
    """One generator per invoke once each site has been audited; every invoke sees and edits
    only its rows, as each row run alone with plain hooks."""
    model = gpt2_model
    references = [_reference(gpt2, ids[i:i + 1], zero_mlp1=(i == 1)) for i in range(2)]
    history = []
    for _ in range(4):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(ids[:1]):
                kind_a = interlace.save(_kind(model))
                mlp_a = model.transformer.h[0].mlp.output.save()
                logits_a = model.lm_head.output.save()
            with tracer.invoke(ids[1:]):
                kind_b = interlace.save(_kind(model))
                mlp_b = model.transformer.h[0].mlp.output.save()
                model.transformer.h[1].mlp.output = model.transformer.h[1].mlp.output * 0
                logits_b = model.lm_head.output.save()
        history.append((kind_a, kind_b))
        for (mlp0, logits), mlp, out in zip(references, (mlp_a, mlp_b), (logits_a, logits_b)):
            assert torch.allclose(mlp, mlp0, atol=1e-6) and torch.allclose(out, logits, atol=1e-5)
    # (the invokes' sites are audited twice: the trace's body that holds them is compiled
    # again once the names it assigns are bound in the caller, which makes new sites)
    assert history == [("AuditMediator",) * 2] * 2 + [("GeneratorMediator",) * 2] * 2


def test_invokes_that_share_a_variable_stay_on_greenlets_and_patch(gpt2, gpt2_model, ids):
    """A later invoke that reads an earlier one's variable waits for it: on greenlets, every run."""
    model = gpt2_model
    clean, corrupt = ids[:1], ids[1:]
    seen = {}

    def grab(m, a, out):
        seen["h"] = out[0][:, -1].clone()

    def patch(m, a, out):
        out[0][:, -1] = seen["h"]

    block = gpt2.transformer.h[1]
    with torch.no_grad():
        handle = block.register_forward_hook(grab)
        gpt2(clean)
        handle.remove()
        handle = block.register_forward_hook(patch)
        want = gpt2(corrupt).logits
        handle.remove()
    for _ in range(3):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(clean):
                h = model.transformer.h[1].output[0][:, -1]
            with tracer.invoke(corrupt):
                kind = interlace.save(_kind(model))
                model.transformer.h[1].output[0][:, -1] = h
                logits = model.lm_head.output.save()
        assert kind == "Mediator"
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_invokes_meeting_at_a_barrier_run_again_and_again_as_their_first_run(gpt2, gpt2_model, ids):
    """A barrier's wait between invokes that share no variable (a dict passes the value),
    run three times: the same patched logits each time, whatever route each site takes."""
    model = gpt2_model
    clean, corrupt = ids[:1], ids[1:]
    seen = {}

    def grab(m, a, out):
        seen["h"] = out[0][:, 0].clone()

    def patch(m, a, out):
        out[0][:, 0] = seen["h"]

    with torch.no_grad():
        handle = gpt2.transformer.h[0].register_forward_hook(grab)
        gpt2(corrupt)
        handle.remove()
        handle = gpt2.transformer.h[1].register_forward_hook(patch)
        want = gpt2(clean).logits
        handle.remove()
    for _ in range(3):
        box = {}
        with torch.no_grad(), model.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(clean):
                barrier()
                model.transformer.h[1].output[0][:, 0] = box["h"]
                logits = model.lm_head.output.save()
            with tracer.invoke(corrupt):
                box["h"] = model.transformer.h[0].output[0][:, 0].clone()
                barrier()
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_a_replaced_body_job_method_is_still_called(gpt2_model, ids, monkeypatch):
    """The compiled extension starts and ends a plain BodyJob's generator body itself
    (`hotpath.plain_job`); a `generator` or `finish` replaced since is called as usual, and
    the values are the same either way."""
    from interlace.intervention.body import BodyJob

    def run():
        with torch.no_grad(), gpt2_model.trace() as tracer:
            with tracer.invoke(ids[:1]):
                a = gpt2_model.transformer.h[0].output.save()
            with tracer.invoke(ids[1:]):
                b = gpt2_model.transformer.h[1].output.save()
        return a, b

    for _ in range(3):
        plain = run()
    calls = []
    generator, finish = BodyJob.generator, BodyJob.finish
    monkeypatch.setattr(BodyJob, "generator", lambda job: calls.append("generator") or generator(job))
    monkeypatch.setattr(BodyJob, "finish", lambda job, values: calls.append("finish") or finish(job, values))
    replaced = run()
    assert calls == ["generator", "generator", "finish", "finish"]
    for got, expected in zip(replaced, plain):
        assert torch.equal(got, expected)
