"""The express run (intervention/express.py): a warm generator-body trace served without the
general run, handing over to it for whatever it does not serve.

Every case runs each site three times (the first run of a site is its audit, on a greenlet;
the later ones are express runs) and compares with an independent reference: plain torch
hooks on the same module, or the same body with the express run turned off (where the
question is that both routes give the same errors). `runs` counts the express runs and
hand-overs, so that a case that should be express really is.
"""

import collections
import os
import subprocess
import sys
import threading
import traceback
import types
import warnings

import pytest
import torch

import interlace
from interlace.errors import ForwardReplacedWarning, InterlaceError, OutOfOrderError
from interlace.intervention import engine as engine_module
from interlace.intervention import express, routes

from .helpers import hooked

pytestmark = pytest.mark.skipif(
    not (routes.ENABLED and express.ENABLED),
    reason="generator bodies or the express run are forced off (INTERLACE_GENERATORS=0, INTERLACE_EXPRESS=0)",
)


@pytest.fixture
def runs(monkeypatch):
    """Counts of express runs and of hand-overs while the test runs."""
    counts = {"express": 0, "handed over": 0}
    run, hand_over = express.Express.run, express.Express.hand_over

    def counted_run(self, *args):
        counts["express"] += 1
        return run(self, *args)

    def counted_hand_over(self):
        counts["handed over"] += 1
        return hand_over(self)

    monkeypatch.setattr(express.Express, "run", counted_run)
    monkeypatch.setattr(express.Express, "hand_over", counted_hand_over)
    return counts


def _hooked(gpt2, ids, paths, edit=None):
    """Outputs of the modules at `paths` (and the logits) by plain torch hooks; `edit`:
    {path: fn(output) -> replacement}."""
    seen, hooks = {}, {}
    for path in set(paths) | set(edit or {}):
        def hook(module, args, output, path=path):
            if edit and path in edit:
                output = edit[path](output)
            seen[path] = output
            return output
        hooks[gpt2.get_submodule(path)] = hook
    with torch.no_grad(), hooked(gpt2, output=hooks):
        logits = gpt2(ids).logits
    return seen, logits


def _first(output):
    """A block's hidden states (a tuple's first item in older `transformers`)."""
    return output[0] if isinstance(output, tuple) else output


def _clean(gpt2):
    """The module is as it was: no instance forward or hook left on any submodule."""
    for name, module in gpt2.named_modules():
        assert "forward" not in module.__dict__, name
        assert not module._forward_hooks and not module._forward_pre_hooks, name


def test_warm_reads_take_the_express_run_and_see_the_hooks_values(gpt2, gpt2_model, ids, runs):
    seen, logits = _hooked(gpt2, ids, ["transformer.h.0", "transformer.h.1.mlp"])
    for _ in range(3):
        with torch.no_grad(), gpt2_model.trace(ids) as tracer:
            h0 = gpt2_model.transformer.h[0].output.save()
            again = gpt2_model.transformer.h[0].output.save()  # the same value, read twice
            mlp1 = gpt2_model.transformer.h[1].mlp.output.save()
            out = gpt2_model.output.save()
            result = tracer.result.save()
        assert torch.equal(_first(h0), _first(seen["transformer.h.0"])) and again is h0
        assert torch.equal(mlp1, seen["transformer.h.1.mlp"])
        assert torch.equal(out.logits, logits) and result is out
    assert runs == {"express": 2, "handed over": 0}
    _clean(gpt2)


def test_a_write_replaces_the_value_downstream(gpt2, gpt2_model, ids, runs):
    _, logits = _hooked(gpt2, ids, [], edit={"transformer.h.0.mlp": torch.zeros_like})
    for _ in range(3):
        with torch.no_grad(), gpt2_model.trace(ids):
            mlp = gpt2_model.transformer.h[0].mlp
            mlp.output = torch.zeros_like(mlp.output)
            zeroed = mlp.output.save()
            out = gpt2_model.lm_head.output.save()
        assert torch.equal(zeroed, torch.zeros_like(zeroed))
        assert torch.equal(out, logits)
    assert runs == {"express": 2, "handed over": 0}


def test_a_container_read_from_inside_is_served_when_it_returns(gpt2, gpt2_model, ids, runs):
    seen, _ = _hooked(gpt2, ids, ["transformer.h.1", "transformer"])
    for _ in range(3):
        with torch.no_grad(), gpt2_model.trace(ids):
            h1 = gpt2_model.transformer.h[1].output.save()
            body = gpt2_model.transformer.output.save()
        assert torch.equal(_first(h1), _first(seen["transformer.h.1"]))
        assert torch.equal(body.last_hidden_state, seen["transformer"].last_hidden_state)
    assert runs == {"express": 2, "handed over": 0}


def test_an_input_hands_over_and_still_sees_the_hooks_values(gpt2, gpt2_model, ids, runs):
    seen, _ = _hooked(gpt2, ids, ["transformer.h.0"])
    inputs = []
    handle = gpt2.transformer.h[1].register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    try:
        for _ in range(3):
            with torch.no_grad(), gpt2_model.trace(ids):
                h0 = gpt2_model.transformer.h[0].output.save()
                x1 = gpt2_model.transformer.h[1].input.save()
                gpt2_model.transformer.h[1].mlp.output = gpt2_model.transformer.h[1].mlp.output * 0
                out = gpt2_model.lm_head.output.save()
            assert torch.equal(_first(h0), _first(seen["transformer.h.0"]))
            assert torch.equal(x1, inputs[-1])
    finally:
        handle.remove()
    _, zeroed = _hooked(gpt2, ids, [], edit={"transformer.h.1.mlp": lambda o: o * 0})
    assert torch.equal(out, zeroed)
    assert runs == {"express": 2, "handed over": 2}
    _clean(gpt2)


def _errors(gpt2_model, ids, body, monkeypatch, on):
    """What `body(model, ids, fail)` raises (type, message, the interlace frames in its
    traceback) on two runs with `fail=True`, after one run without (so that its site
    has run once: it takes the generator route, hence the express run, from then on)."""
    monkeypatch.setattr(engine_module, "_EXPRESS", on)
    body(gpt2_model, ids, False)
    raised = []
    for _ in range(2):
        try:
            body(gpt2_model, ids, True)
        except Exception as error:  # noqa: BLE001 - compared below
            ours = [frame.name for frame in traceback.extract_tb(error.__traceback__)
                    if "interlace" + os.sep in frame.filename]
            raised.append((type(error), str(error), ours))
        else:
            raised.append(None)
    return raised


def _out_of_order(model, ids, fail):
    with torch.no_grad(), model.trace(ids):
        first = model.transformer.h[1 if fail else 0]
        then = model.transformer.h[0 if fail else 1]
        first.output.save()
        then.output.save()


def _never_called(model, ids, fail):
    with torch.no_grad(), model.trace(ids):
        model.transformer.h[0].output.save()
        if fail:
            model.transformer.h[1].attn.attn_dropout.output.save()  # eager attention: not called


def _body_raises(model, ids, fail):
    with torch.no_grad(), model.trace(ids):
        h = model.transformer.h[0].output
        if fail:
            raise KeyError(f"from the body {type(h).__name__}")


def _body_raises_at_start(model, ids, fail):
    with torch.no_grad(), model.trace(ids):
        if fail:
            raise KeyError("before any read")
        model.transformer.h[0].output.save()


def _model_raises(model, ids, fail):
    with torch.no_grad(), model.trace(ids.float() if fail else ids):  # the embedding refuses floats
        model.transformer.h[0].output.save()


@pytest.mark.parametrize("body", [_out_of_order, _never_called, _body_raises, _body_raises_at_start,
                                  _model_raises], ids=lambda f: f.__name__.strip("_"))
def test_errors_are_the_general_runs(gpt2, gpt2_model, ids, monkeypatch, runs, body):
    general = _errors(gpt2_model, ids, body, monkeypatch, False)
    got = _errors(gpt2_model, ids, body, monkeypatch, True)
    assert got == general and all(error is not None for error in got)
    # no interlace frame in a traceback (the twin keeps its `__exit__`: README, Known limits)
    assert all(error[2] == ([] if interlace.native else ["__exit__"]) for error in got)
    assert runs["express"] == 3  # (the site ran once on the general route first)
    _clean(gpt2)


def test_out_of_order_and_never_produced_errors_hand_over(gpt2_model, ids, runs):
    for body in (_out_of_order, _never_called):
        body(gpt2_model, ids, False)  # (the site's first run, if it is: its audit)
    runs.update({"express": 0, "handed over": 0})
    for body in (_out_of_order, _never_called):
        with pytest.raises(OutOfOrderError):
            body(gpt2_model, ids, True)
    assert runs == {"express": 2, "handed over": 2}


class _Skips(torch.nn.Module):
    """Calls `b` only while `use_b`: its learned order has `b`, a later run may not."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.use_b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), True

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def _read_b(model, x):
    with torch.no_grad(), model.trace(x):
        model.a.output.save()
        got = model.b.output.save()
    return got


def _write_b(model, x):
    with torch.no_grad(), model.trace(x):
        model.b.output = torch.zeros(1, 2)
        got = model.b.output.save()
    return got


@pytest.mark.parametrize("express_on", [True, False])
@pytest.mark.parametrize("body", [_read_b, _write_b])
def test_a_read_or_write_waiting_when_the_run_hands_over_asks_the_general_run(monkeypatch, runs, express_on, body):
    """The body waits to read (or to write) `b`, which the learned order has but this forward
    never calls: the root returns, the run hands over, and the waiting read or write is asked
    of the general run (the compiled one, `_ExpressRead`, forwards to it): the same error as
    with the express run off, then the model as it was."""
    monkeypatch.setattr(engine_module, "_EXPRESS", express_on)
    net = _Skips()
    model = interlace.Model(net)
    x = torch.ones(1, 2)

    def expected():
        return net.b(net.a(x)) if body is _read_b else torch.zeros(1, 2)

    for _ in range(3):  # learn the order with `b` called, then warm runs
        assert torch.equal(body(model, x), expected())
    net.use_b = False
    with pytest.raises(Exception) as raised:
        body(model, x)
    handed_over = runs["handed over"]
    monkeypatch.setattr(engine_module, "_EXPRESS", False)
    with pytest.raises(Exception) as general:
        body(model, x)
    assert type(raised.value) is type(general.value) and str(raised.value) == str(general.value)
    assert handed_over == (1 if express_on else 0)
    net.use_b = True
    monkeypatch.setattr(engine_module, "_EXPRESS", express_on)
    assert torch.equal(body(model, x), expected())
    assert "forward" not in net.a.__dict__ and "forward" not in net.b.__dict__


def test_a_write_ahead_waits_for_its_module_then_replaces_the_value(gpt2, gpt2_model, ids, runs):
    """`mlp.output = value` for a module the model has not reached yet (nothing read there
    first): the compiled write waits (`ExpressCore.writer`) and replaces the output once
    the module returns, as a plain hook returning `value` would."""
    shape = _hooked(gpt2, ids, ["transformer.h.1.mlp"])[0]["transformer.h.1.mlp"].shape
    value = torch.full(shape, 0.5)
    _, logits = _hooked(gpt2, ids, [], edit={"transformer.h.1.mlp": lambda output: value})
    for _ in range(3):
        with torch.no_grad(), gpt2_model.trace(ids):
            gpt2_model.transformer.h[1].mlp.output = value
            written = gpt2_model.transformer.h[1].mlp.output.save()
            out = gpt2_model.lm_head.output.save()
        assert written is value and torch.equal(out, logits)
    assert runs == {"express": 2, "handed over": 0}
    _clean(gpt2)


def test_a_write_ahead_the_model_then_fails_on_is_named_at_its_line(gpt2_model, ids, runs):
    import inspect

    lines, first = inspect.getsourcelines(test_a_write_ahead_the_model_then_fails_on_is_named_at_its_line)
    line = first + next(i for i, text in enumerate(lines) if text.strip().startswith("gpt2_model.transformer.h[1].mlp.output ="))
    notes = []
    for width in (64, 7, 7):
        try:
            with torch.no_grad(), gpt2_model.trace(ids):
                gpt2_model.transformer.h[1].mlp.output = torch.zeros(2, 12, width)
        except RuntimeError as error:
            notes.append(getattr(error, "__notes__", None))
    expected = (f"interlace: the trace body set model.transformer.h.1.mlp.output at {__file__}:{line} "
                f"before the model raised this; check the value assigned there")
    assert notes == [[expected]] * 2 if sys.version_info >= (3, 11) else len(notes) == 2
    assert runs["express"] == 2


def test_a_module_call_in_the_body_hands_over_mid_forward(gpt2, gpt2_model, ids, runs):
    seen, logits = _hooked(gpt2, ids, ["transformer.h.0", "transformer.h.1"])
    for _ in range(3):
        with torch.no_grad(), gpt2_model.trace(ids):
            h0 = gpt2_model.transformer.h[0].output
            again = gpt2_model.transformer.h[1](_first(h0))  # runs as a plain module
            h1 = gpt2_model.transformer.h[1].output.save()
            same = interlace.save(torch.equal(_first(again), _first(h1)))
            out = gpt2_model.lm_head.output.save()
        assert torch.equal(_first(h1), _first(seen["transformer.h.1"])) and same
        assert torch.equal(out, logits)
    assert runs == {"express": 2, "handed over": 2}
    _clean(gpt2)


def test_a_module_with_a_hook_of_its_own_hands_over_and_keeps_it(gpt2, gpt2_model, ids, runs):
    calls = []
    handle = gpt2.transformer.h[0].mlp.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        seen, _ = _hooked(gpt2, ids, ["transformer.h.0.mlp"])
        for _ in range(3):
            with torch.no_grad(), gpt2_model.trace(ids):
                mlp = gpt2_model.transformer.h[0].mlp.output.save()
            assert torch.equal(mlp, seen["transformer.h.0.mlp"])
    finally:
        handle.remove()
    assert len(calls) == 4 and runs == {"express": 2, "handed over": 2}
    _clean(gpt2)


@pytest.mark.parametrize("change", ["container's hook", "class forward", "instance forward",
                                    "hook dict replaced in a run"])
def test_a_warm_run_checks_its_wrappers_plan_again(gpt2, gpt2_model, ids, runs, monkeypatch, change):
    """A warm express run repeats only the checks of the wrappers it planned on its first
    read of a location (hotpath.ExpressCore.ahead), and natively cuts them short while the
    module's instance dict and class are as last checked (their versions): a hook added
    since on a module that contains the one read, the class's forward patched, a forward
    set on the instance, or a hook dict replaced while a run had its wrapper set, must
    still be seen."""
    block, mlp = gpt2.transformer.h[0], gpt2.transformer.h[0].mlp
    for _ in range(3):  # the audit, then warm runs that keep the plan for h[0].mlp
        with torch.no_grad(), gpt2_model.trace(ids):
            gpt2_model.transformer.h[0].mlp.output.save()
    assert runs["express"] >= 2 and runs["handed over"] == 0
    calls = []
    if change == "container's hook":
        handle = block.register_forward_hook(lambda m, a, o: calls.append(1))
        undo = handle.remove
    elif change == "class forward":
        forward = type(mlp).forward
        monkeypatch.setattr(type(mlp), "forward", lambda self, x: forward(self, x) * 2)
        undo = lambda: None  # noqa: E731 - monkeypatch puts the class's forward back
    elif change == "instance forward":
        block.forward = types.MethodType(type(block).forward, block)  # (the same forward)
        undo = lambda: block.__dict__.pop("forward")  # noqa: E731
    else:  # a run's body replaces the block's hook dict while the block's wrapper is set
        hooks = collections.OrderedDict({0: lambda m, a, o: calls.append(1)})
        with torch.no_grad(), gpt2_model.trace(ids):
            gpt2_model.transformer.h[0].mlp.output.save()
            block._forward_hooks = hooks
        undo = lambda: setattr(block, "_forward_hooks", collections.OrderedDict())  # noqa: E731
        change = "container's hook"  # (from now on the same case)
    try:
        seen, logits = _hooked(gpt2, ids, ["transformer.h.0.mlp"])
        calls.clear()
        with warnings.catch_warnings():  # (a forward set on the instance warns, by design)
            warnings.simplefilter("ignore", ForwardReplacedWarning)
            for _ in range(2):
                with torch.no_grad(), gpt2_model.trace(ids):
                    out = gpt2_model.transformer.h[0].mlp.output.save()
                    got = gpt2_model.output.save()
                assert torch.equal(out, seen["transformer.h.0.mlp"]) and torch.equal(got.logits, logits)
    finally:
        undo()
    if change == "container's hook":
        assert len(calls) == 2 and runs["handed over"] >= 1  # the general run keeps the hook
    if change == "instance forward":
        assert runs["handed over"] >= 2  # a forward of its own: the general run, each time
    _clean(gpt2)


def test_grad_mode_is_the_bodys_across_a_read_and_the_models_after(gpt2_model, ids, runs):
    for _ in range(3):
        with gpt2_model.trace(ids):
            torch.set_grad_enabled(False)
            gpt2_model.transformer.h[0].output
            in_body = interlace.save(torch.is_grad_enabled())
            h1 = gpt2_model.transformer.h[1].output.save()
            needs = interlace.save(_first(h1).requires_grad)
        assert in_body is False and needs is True and torch.is_grad_enabled()
    assert runs["express"] == 2


def test_a_read_from_another_thread_gets_the_general_runs_error(gpt2_model, ids, runs):
    errors = []

    def other():
        try:
            gpt2_model.transformer.h[0].output
        except InterlaceError as error:
            errors.append(str(error))

    for _ in range(3):
        with torch.no_grad(), gpt2_model.trace(ids):
            h = gpt2_model.transformer.h[0].output.save()
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
    assert errors == [
        "model.transformer.h.0.output can only be read inside the body of the `with "
        "model.trace(...)` block that is running it (not from another thread or after the block)"
    ] * 3
    assert runs == {"express": 2, "handed over": 0} and h is not None


def test_interlace_express_0_turns_it_off():
    code = (
        "import torch, interlace\n"
        "from interlace.intervention import express\n"
        "assert not express.ENABLED\n"
        "ran = []\n"
        "run = express.Express.run\n"
        "express.Express.run = lambda self, *a: ran.append(1) or run(self, *a)\n"
        "model = interlace.Model(torch.nn.Sequential(torch.nn.Linear(2, 2)))\n"
        "for _ in range(3):\n"
        "    with model.trace(torch.ones(1, 2)):\n"
        "        h = model[0].output.save()\n"
        "assert ran == [] and h.shape == (1, 2)\n"
    )
    env = dict(os.environ, INTERLACE_EXPRESS="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_tracer_class_kept_off_the_route_stays_off_after_an_allowed_one_ran(gpt2, gpt2_model, ids, runs):
    # The engine remembers the tracer class it last allowed an express run (a warm trace
    # skips the class check): a class kept off the generator route, traced at the same line
    # between that class's traces, must still never take the express run.
    from interlace.intervention.tracer import InterleavingTracer

    class OwnBuild(InterleavingTracer):
        def build(self, node):
            return super().build(node)

    seen, _ = _hooked(gpt2, ids, ["transformer.h.0"])

    def trace(cls):
        with torch.no_grad(), gpt2_model.trace(ids, tracer_cls=cls):
            h0 = gpt2_model.transformer.h[0].output.save()
        assert torch.equal(_first(h0), _first(seen["transformer.h.0"]))

    for cls, express_runs in ((None, 2), (OwnBuild, 2), (None, 5), (OwnBuild, 5)):
        for _ in range(3):
            trace(cls)
        assert runs == {"express": express_runs, "handed over": 0}, cls
