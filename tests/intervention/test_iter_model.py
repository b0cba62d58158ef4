"""`tracer.iter` on a plain `Model` (not only LanguageModel): a module that runs a submodule
several times per forward gives occurrences 0, 1, 2, and the loop pins each step in turn."""

import pytest
import torch

import interlace


class Repeat(torch.nn.Module):
    """Applies the same layer three times: occurrences 0, 1, 2 of `layer` in one run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.layer(x))
        return x


def plain_occurrences(module, x):
    seen = []
    handle = module.layer.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            module(x)
    finally:
        handle.remove()
    return seen


@pytest.fixture
def repeat():
    module = Repeat()
    return module, interlace.Model(module), torch.randn(2, 4)


def test_iter_slice_binds_each_step_to_its_occurrence(repeat):
    module, model, x = repeat
    expected = plain_occurrences(module, x)
    with torch.no_grad(), model.trace(x) as tracer:
        outs = [].save()
        for step in tracer.iter[:3]:
            outs.append(model.layer.output.clone())
    assert len(outs) == 3
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got, want)
    assert not torch.equal(outs[0], outs[2])


def test_iter_single_step_reads_only_that_occurrence(repeat):
    module, model, x = repeat
    expected = plain_occurrences(module, x)
    with torch.no_grad(), model.trace(x) as tracer:
        outs = [].save()
        for step in tracer.iter[2]:
            outs.append(model.layer.output.clone())
    assert len(outs) == 1
    torch.testing.assert_close(outs[0], expected[2])


def test_iter_edit_at_one_step_matches_plain_hook_edit(repeat):
    module, model, x = repeat

    def zero_second(mod, args, out, calls=[0]):
        calls[0] += 1
        return out * 0 if calls[0] == 2 else out

    handle = module.layer.register_forward_hook(zero_second)
    try:
        with torch.no_grad():
            want = module(x)
    finally:
        handle.remove()
    with torch.no_grad():
        unedited = module(x)
    with torch.no_grad(), model.trace(x) as tracer:
        for step in tracer.iter[1]:
            model.layer.output = model.layer.output * 0
        result = tracer.result.save()
    torch.testing.assert_close(result, want)
    assert not torch.allclose(result, unedited)


def test_iter_past_the_last_occurrence_is_cut_short_with_a_warning(repeat):
    module, model, x = repeat
    expected = plain_occurrences(module, x)
    with pytest.warns(interlace.IterationCutShortWarning):
        with torch.no_grad(), model.trace(x) as tracer:
            outs = [].save()
            for step in tracer.iter[:5]:
                outs.append(model.layer.output.clone())
            after = "ran".save()
    assert len(outs) == 3
    torch.testing.assert_close(outs[2], expected[2])
    with pytest.raises(NameError):
        after  # noqa: B018 - code after a cut-short loop does not run
