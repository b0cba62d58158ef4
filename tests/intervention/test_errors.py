"""Errors: what the user did, where, and what to do; and the model left clean afterwards."""

import gc
import sys
import threading
import traceback

import greenlet

import pytest
import torch

import interlace
from interlace import InterlaceError, OutOfOrderError
from interlace.intervention import mediator as mediator_module
from interlace.intervention.access import engine_of

from .helpers import assert_clean, logits


def _lines(error):
    return [(f.filename, f.lineno) for f in traceback.extract_tb(error.__traceback__)]


def _works_after(model, module, x):
    """The next trace after an error is correct and leaves nothing behind."""
    with torch.no_grad(), model.trace(x):
        out = model.output.save()
    with torch.no_grad():
        assert torch.equal(logits(out), logits(module(x)))
    assert_clean(module)
    assert engine_of(model).running is None and not engine_of(model).lock.locked()


@pytest.mark.parametrize("warm", [False, True], ids=["learning", "learned"])
def test_out_of_order_names_location_occurrence_and_what_ran(gpt2, warm, ids):
    model = interlace.Model(gpt2)
    if warm:
        with torch.no_grad(), model.trace(ids):
            pass
    with pytest.raises(OutOfOrderError) as info:
        with torch.no_grad(), model.trace(ids):
            late = model.transformer.h[1].output  # noqa: F841
            early = model.transformer.h[0].mlp.output  # noqa: F841 - already passed
    message = str(info.value)
    assert "model.transformer.h.0.mlp.output (occurrence 0) was requested after the model had " \
           "already produced it" in message
    assert "the model is at model.transformer.h.1.output (occurrence 0)" in message
    assert "read model.transformer.h.0.mlp.output earlier in the body" in message
    assert "model.transformer.h.0.mlp" in message.split("Module order:")[1]
    assert (__file__, _line_of("early = model.transformer.h[0].mlp.output")) in _lines(info.value)
    _works_after(model, gpt2, ids)


def _line_of(text):
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return number
    raise AssertionError(text)


def test_location_that_never_runs(mlp):
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = mlp
            self.spare = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    module = Unused()
    model = interlace.Model(module)
    x = torch.ones(1, 6)
    for _ in range(2):  # learning, then learned
        with pytest.raises(OutOfOrderError) as info:
            with torch.no_grad(), model.trace(x):
                model.spare.output.save()
        message = str(info.value)
        assert "model.spare.output (occurrence 0) was never produced: it never ran in this run" in message
        assert "Modules that ran, in order: model.used.0, model.used.1" in message
        assert (__file__, _line_of("model.spare.output.save()")) in _lines(info.value)
        assert_clean(module)


def test_occurrence_beyond_the_run(mlp, mlp_model, x6):
    with pytest.raises(OutOfOrderError, match=r"model\.2\.output \(occurrence 3\) was never produced: "
                                              r"the run ended after 1 occurrence\(s\) of it \(0\.\.0\)"):
        with torch.no_grad(), mlp_model.trace(x6):
            mlp_model._active().mediator().pointer.pin(3)
            mlp_model[2].output.save()
    _works_after(mlp_model, mlp, x6)


def test_body_exception_keeps_type_and_user_line(mlp, mlp_model, x6):
    class Mine(Exception):
        pass

    with pytest.raises(Mine, match="boom") as info:
        with mlp_model.trace(x6):
            h = mlp_model[0].output  # noqa: F841
            raise Mine("boom")
    assert (__file__, _line_of('raise Mine("boom")')) in _lines(info.value)
    assert not any("interlace/intervention" in f for f, _ in _lines(info.value))
    _works_after(mlp_model, mlp, x6)


def test_torch_error_in_body_is_a_python_exception(mlp, mlp_model, x6):
    # a c10::Error raised (with its C++ backtrace) while the mediator's stack is live
    for _ in range(3):
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            with mlp_model.trace(x6):
                h = mlp_model[0].output
                torch.zeros(3, 5) @ h  # noqa: B018
    _works_after(mlp_model, mlp, x6)


def test_shape_error_from_an_assigned_value(gpt2, gpt2_model, ids):
    with pytest.raises(RuntimeError) as info:
        with torch.no_grad(), gpt2_model.trace(ids):
            gpt2_model.transformer.h[0].mlp.output = torch.zeros(2, 12, 7)
    assert "size" in str(info.value) or "shape" in str(info.value)
    assert any(f == __file__ for f, _ in _lines(info.value))
    if sys.version_info >= (3, 11):  # (notes are 3.11+) the note names the assignment
        line = _line_of("gpt2_model.transformer.h[0].mlp.output = torch.zeros(2, 12, 7)")
        assert info.value.__notes__ == [
            f"interlace: the trace body set model.transformer.h.0.mlp.output at {__file__}:{line} "
            f"before the model raised this; check the value assigned there"
        ]
    _works_after(gpt2_model, gpt2, ids)


def test_failing_traces_do_not_accumulate(mlp, mlp_model, x6):
    def failing():
        try:
            with torch.no_grad(), mlp_model.trace(x6):
                mlp_model[4].output
                mlp_model[0].output
        except OutOfOrderError:
            pass

    for _ in range(200):
        failing()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(1000):
        failing()
    gc.collect()
    assert len(gc.get_objects()) <= before + 10
    assert_clean(mlp)


def test_keyboard_interrupt_during_forward_leaves_model_clean(mlp, x6):
    class Interrupting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = mlp
            self.armed = True

        def forward(self, x):
            h = self.inner[0](x)
            if self.armed:
                raise KeyboardInterrupt()
            return self.inner[4](torch.tanh(self.inner[2](torch.relu(h))))

    module = Interrupting()
    model = interlace.Model(module)
    idle_before = len(mediator_module.WORKERS.idle)
    for _ in range(2):
        module.armed = True
        with pytest.raises(KeyboardInterrupt):
            with torch.no_grad(), model.trace(x6):
                h = model.inner[0].output.save()
                later = model.inner[4].output.save()  # parked when the interrupt hits  # noqa: F841
        assert_clean(module)
        assert engine_of(model).running is None and not engine_of(model).lock.locked()
        # the parked body was unwound and its worker returned to the pool, not left suspended
        assert len(mediator_module.WORKERS.idle) >= max(idle_before, 1)
        assert all(not w.dead and w.gr_frame is not None for w in mediator_module.WORKERS.idle)
    module.armed = False
    with torch.no_grad(), model.trace(x6):
        out = model.output.save()
    assert torch.equal(out, mlp(x6).detach())


def test_no_suspended_greenlet_after_errors(mlp, mlp_model, x6):
    with pytest.raises(OutOfOrderError):
        with mlp_model.trace(x6):
            mlp_model[4].output
            mlp_model[0].output
    gc.collect()
    suspended = [
        g for g in gc.get_objects()
        if issubclass(type(g), greenlet.greenlet) and g and g not in mediator_module.WORKERS.idle
        and g is not greenlet.getcurrent()
    ]
    assert suspended == []


def test_body_that_catches_out_of_order_and_continues(mlp, mlp_model, x6):
    with torch.no_grad(), mlp_model.trace(x6):
        late = mlp_model[4].output.save()
        try:
            mlp_model[0].output
        except OutOfOrderError:
            caught = interlace.save(["yes"])
    assert caught == ["yes"]
    assert torch.equal(late, mlp(x6).detach())


def test_read_after_run_finished(mlp_model, x6):
    with pytest.raises(OutOfOrderError, match=r"model\.0\.output \(occurrence 0\) was requested "
                                              r"after the model had already produced it \(1 "
                                              r"occurrence\(s\) so far; the model is at tracer.result"):
        with mlp_model.trace(x6) as tracer:
            tracer.result
            mlp_model[0].output


def test_nested_trace_of_same_model(mlp_model, x6):
    with pytest.raises(InterlaceError, match="this model is already being traced in this thread"):
        with mlp_model.trace(x6):
            with mlp_model.trace(x6):
                pass


def test_value_read_in_a_nested_trace_of_another_model(mlp_model, x6):
    """The outer model's run waits for the inner trace: its values cannot come there, and the
    error says so (not "another thread")."""
    other = interlace.Model(torch.nn.Sequential(torch.nn.Linear(6, 3)))
    with pytest.raises(InterlaceError, match=r"^model\.0\.output was read in the body of a "
                                             r"trace of another model, nested in the body that "
                                             r"traces this one.*before or after the inner"):
        with mlp_model.trace(x6):
            with other.trace(x6):
                h = mlp_model[0].output.save()  # noqa: F841


def test_value_read_from_another_thread(mlp_model, x6):
    errors = []

    def other():
        try:
            mlp_model[0].output
        except InterlaceError as error:
            errors.append(str(error))

    with mlp_model.trace(x6):
        mlp_model[0].output
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert errors == [
        "model.0.output can only be read inside the body of the `with model.trace(...)` block "
        "that is running it (not from another thread or after the block)"
    ]


def test_two_threads_tracing_one_model(gpt2, gpt2_model):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 1000, (1, 8), generator=g) for _ in range(4)]
    with torch.no_grad():
        expected = [gpt2(p).logits for p in prompts]
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            barrier.wait()
            for _ in range(5):
                for j in range(i, 4, 2):
                    with torch.no_grad(), gpt2_model.trace(prompts[j]):
                        gpt2_model.transformer.h[0].output[:] *= 1.0
                        out = gpt2_model.lm_head.output.save()
                    results.setdefault(j, []).append(out)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for j in range(4):
        assert len(results[j]) == 5
        for out in results[j]:
            assert torch.allclose(out, expected[j], atol=1e-6)
    assert_clean(gpt2)
