"""`envoy(x, hook=True)` on a module attached after wrapping: what a body gets back, errors,
and the model's own modules (see tests/models/test_attach.py for edits, invokes, generation
and sweeps). References: plain torch calls of the same modules."""

import pytest
import torch

import interlace

IDS = torch.tensor([[1, 2, 3, 4]])


class Probe(torch.nn.Module):
    """A small attachment with a submodule; `fail=True` raises inside its forward."""

    def __init__(self, hidden=64, fail=False):
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(hidden, hidden)
        self.fail = fail

    def forward(self, h):
        if self.fail:
            raise ValueError("probe failed")
        return torch.tanh(self.lin(h))


@pytest.fixture
def model(gpt2):
    """A wrapper of the session GPT-2 with a probe attached (detached again afterwards)."""
    wrapped = interlace.Model(gpt2)
    wrapped.transformer.h[0].mlp.probe = Probe()
    yield wrapped
    del gpt2.transformer.h[0].mlp.probe


def test_a_watched_call_returns_what_the_module_returns_and_serves_its_internals(model, gpt2):
    probe = gpt2.transformer.h[0].mlp.probe
    with torch.no_grad(), model.trace(IDS):
        h = model.transformer.h[0].mlp.output
        out = model.transformer.h[0].mlp.probe(h, hook=True).save()
        h_saved = h.save()
    with model.edit() as edited:  # (a body waiting for `lin` cannot call the probe itself)
        edited.transformer.h[0].mlp.probe(edited.transformer.h[0].mlp.output, hook=True)
    with torch.no_grad(), edited.trace(IDS):
        lin = edited.transformer.h[0].mlp.probe.lin.output.save()
    with torch.no_grad():
        assert torch.equal(out, probe(h_saved))
        assert torch.equal(lin, probe.lin(h_saved))


def test_an_attachment_read_outside_a_trace_says_how_it_runs(model):
    with pytest.raises(interlace.NotInTraceError, match=r"probe\(x, hook=True\)"):
        model.transformer.h[0].mlp.probe.output  # noqa: B018


def test_an_attachment_nobody_calls_is_never_produced(model):
    with pytest.raises(interlace.OutOfOrderError, match="probe.lin.output .* never produced"):
        with torch.no_grad(), model.trace(IDS):
            model.transformer.h[0].mlp.probe.lin.output.save()


def test_an_error_inside_the_attachment_is_raised_at_the_bodys_line(model, gpt2):
    gpt2.transformer.h[0].mlp.probe.fail = True
    with pytest.raises(ValueError, match="probe failed") as raised:
        with torch.no_grad(), model.trace(IDS):
            h = model.transformer.h[0].mlp.output
            model.transformer.h[0].mlp.probe(h, hook=True)  # the line
    body_lines = [entry.statement for entry in raised.traceback if str(entry.path) == __file__]
    assert any("# the line" in str(line) for line in body_lines)
    with torch.no_grad(), model.trace(IDS):  # the model is clean and traces again
        logits = model.lm_head.output.save()
    with torch.no_grad():
        assert torch.equal(logits, gpt2(IDS).logits)


def test_hook_true_on_one_of_the_models_own_modules_is_a_plain_call(model, gpt2):
    """Only attachments are watched: the model's own modules keep their place in the run."""
    with torch.no_grad(), model.trace(IDS):
        h = model.transformer.h[0].mlp.output
        again = model.transformer.h[1].mlp(h, hook=True).save()
        mlp1 = model.transformer.h[1].mlp.output.save()
        h = h.save()
    with torch.no_grad():
        assert torch.equal(again, gpt2.transformer.h[1].mlp(h))
        reference = []
        handle = gpt2.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: reference.append(o))
        try:
            gpt2(IDS)
        finally:
            handle.remove()
        assert torch.equal(mlp1, reference[0])
