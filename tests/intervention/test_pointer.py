"""The mediator's iteration pointer (what `tracer.iter` drives), on a module run many times."""

import pytest
import torch

import interlace
from interlace import IterationCutShortWarning, OutOfOrderError

from .helpers import assert_clean, hooked


class Loop(torch.nn.Module):
    """One cell applied `steps` times: occurrences 0..steps-1 of `cell` and `act`."""

    def __init__(self, steps=4):
        super().__init__()
        self.cell = torch.nn.Linear(4, 4)
        self.act = torch.nn.Tanh()
        self.steps = steps

    def forward(self, x):
        for _ in range(self.steps):
            x = self.act(self.cell(x))
        return x


@pytest.fixture(scope="module")
def loop():
    torch.manual_seed(0)
    module = Loop().eval()
    return module, interlace.Model(module)


def _reference(module, x):
    cells, acts = [], []
    with torch.no_grad(), hooked(module, output={
        module.cell: lambda m, a, o: cells.append(o.clone()),
        module.act: lambda m, a, o: acts.append(o.clone()),
    }):
        module(x)
    return cells, acts


@pytest.mark.parametrize("warm", [0, 1])
def test_pin_binds_one_request_then_relaxes(loop, warm):
    module, model = loop
    x = torch.randn(2, 4)
    cells, acts = _reference(module, x)
    with torch.no_grad(), model.trace(x):
        pointer = model._active().mediator().pointer
        got = interlace.save([])
        for step in (0, 2, 3):
            pointer.pin(step)
            got.append(model.cell.output)  # pinned: occurrence `step`
            got.append(model.act.output)  # relaxed: the next act not yet passed = `step`
    for i, step in enumerate((0, 2, 3)):
        assert torch.equal(got[2 * i], cells[step])
        assert torch.equal(got[2 * i + 1], acts[step])


def test_default_pointer_binds_occurrence_zero(loop):
    module, model = loop
    x = torch.randn(2, 4)
    cells, _ = _reference(module, x)
    with torch.no_grad(), model.trace(x):
        first = model.cell.output.save()
        again = model.cell.output.save()  # still occurrence 0: the same event
    assert torch.equal(first, cells[0]) and again is first


def test_edit_at_a_pinned_occurrence(loop):
    module, model = loop
    x = torch.randn(2, 4)
    calls = []

    def zero_third(m, a, o):
        calls.append(1)
        return torch.zeros_like(o) if len(calls) == 3 else None

    with torch.no_grad(), hooked(module, output={module.cell: zero_third}):
        expected = module(x)
    with torch.no_grad(), model.trace(x):
        model._active().mediator().pointer.pin(2)
        model.cell.output = torch.zeros_like(model.cell.output)
        out = model.output.save()
    assert torch.equal(out, expected)
    assert not torch.allclose(out, module(x))


def test_save_restore_nests(loop):
    module, model = loop
    x = torch.randn(2, 4)
    with torch.no_grad(), model.trace(x):
        pointer = model._active().mediator().pointer
        outer = pointer.save()
        pointer.depth += 1
        pointer.pin(1)
        model.cell.output
        inner = pointer.save()
        pointer.pin(3)
        model.cell.output
        pointer.restore(inner)
        states = interlace.save([inner, pointer.save()])
        pointer.restore(outer)
        states.append(pointer.save())
    assert states[0] == states[1] and states[2] == (0, -1, 0)


def test_unreached_step_in_a_loop_is_cut_short_with_a_warning(loop):
    module, model = loop
    x = torch.randn(2, 4)
    cells, _ = _reference(module, x)
    with pytest.warns(IterationCutShortWarning) as record:
        with torch.no_grad(), model.trace(x):
            pointer = model._active().mediator().pointer
            seen = interlace.save([])
            pointer.depth += 1
            for step in range(6):  # the run has 4
                pointer.pin(step)
                seen.append(model.cell.output)
            after = interlace.save(["ran"])  # noqa: F841 - must not run
    assert len(seen) == 4 and all(torch.equal(a, b) for a, b in zip(seen, cells))
    assert "after" not in locals()
    message = str(record[0].message)
    assert "step 4 of model.cell.output was never reached" in message
    assert "values saved in earlier steps are kept" in message
    assert "min_new_tokens=" in message
    assert record[0].filename == __file__
    assert_clean(module)


def test_unreached_occurrence_outside_a_loop_is_an_error(loop):
    module, model = loop
    with pytest.raises(OutOfOrderError, match=r"model\.cell\.output \(occurrence 9\) was never "
                                              r"produced: the run ended after 4 occurrence"):
        with torch.no_grad(), model.trace(torch.randn(2, 4)):
            model._active().mediator().pointer.pin(9)
            model.cell.output
    assert_clean(module)


def test_passed_occurrence_is_out_of_order(loop):
    _, model = loop
    with pytest.raises(OutOfOrderError, match=r"model\.cell\.output \(occurrence 1\) was requested "
                                              r"after the model had already produced it \(3 "
                                              r"occurrence\(s\) so far"):
        with torch.no_grad(), model.trace(torch.randn(2, 4)):
            pointer = model._active().mediator().pointer
            pointer.pin(2)
            model.act.output
            pointer.pin(1)
            model.cell.output
