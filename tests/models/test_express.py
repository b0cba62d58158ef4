"""A LanguageModel trace of a prompt takes the express run (intervention/express.py) from its
site's second run on: the prompt is prepared as one invoke's, then the body's reads are sent
in by the express run's wrappers. Reference: the plain transformers model with plain hooks."""

import pytest
import torch

from conftest import encode, layers
from interlace import save
from interlace.intervention import express, routes

pytestmark = pytest.mark.skipif(
    not (routes.ENABLED and express.ENABLED),
    reason="generator bodies or the express run are forced off (INTERLACE_GENERATORS=0, INTERLACE_EXPRESS=0)",
)


@pytest.fixture
def express_runs(monkeypatch):
    """One entry per express run started from now on in the test."""
    runs = []
    run = express.Express.run
    monkeypatch.setattr(express.Express, "run", lambda self, *a: runs.append(1) or run(self, *a))
    return runs


def hooked_run(hf_model, hooks, *args, **kwargs):
    """`hf_model(*args, **kwargs)` without grad, the hook handles `hooks` removed after it."""
    try:
        with torch.no_grad():
            return hf_model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()


def test_a_prompt_trace_takes_the_express_run_with_the_hooks_values(lm, hf_model, hf_tokenizer, arch,
                                                                    express_runs):
    text = "the capital of france is paris and"
    seen = []
    handle = layers(hf_model, arch)[1].register_forward_hook(
        lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
    logits = hooked_run(hf_model, [handle], encode(hf_tokenizer, text)).logits
    for _ in range(3):
        with torch.no_grad(), lm.trace(text) as tracer:
            h1 = layers(lm, arch)[1].output.save()
            out = tracer.result.logits.save()
        h1 = h1[0] if isinstance(h1, tuple) else h1
        assert torch.equal(h1, seen[0]) and torch.allclose(out, logits, atol=1e-6)
    assert len(express_runs) >= 2  # (the site's first run, under either model, audits it)


def test_one_invoke_is_a_trace_of_its_prompt_and_takes_the_express_run(lm, hf_model, hf_tokenizer, arch,
                                                                       express_runs):
    text = "the capital of france is paris and"
    seen = []
    zero = layers(hf_model, arch)[0].mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
    read = layers(hf_model, arch)[1].register_forward_hook(
        lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
    logits = hooked_run(hf_model, [zero, read], encode(hf_tokenizer, text)).logits
    for _ in range(4):  # (the model's first trace learns its order, the site's first audits it)
        with torch.no_grad(), lm.trace() as tracer:
            before = save(["set before the invoke"])
            with tracer.invoke(text):
                mlp = layers(lm, arch)[0].mlp
                mlp.output = torch.zeros_like(mlp.output)
                h1 = layers(lm, arch)[1].output.save()
                out = tracer.result.logits.save()
            after = save(["set after it"])
        h1 = h1[0] if isinstance(h1, tuple) else h1
        assert torch.equal(h1, seen[0]) and torch.allclose(out, logits, atol=1e-6)
        assert torch.allclose(tracer.result.logits, logits, atol=1e-6)
        assert (before, after) == (["set before the invoke"], ["set after it"])
    assert len(express_runs) >= 2


def test_two_invokes_are_not_an_express_run(lm, hf_tokenizer, arch, express_runs):
    for _ in range(3):
        with torch.no_grad(), lm.trace() as tracer:
            with tracer.invoke("the capital of france"):
                a = layers(lm, arch)[1].output.save()
            with tracer.invoke("paris is"):
                b = layers(lm, arch)[1].output.save()
        a = a[0] if isinstance(a, tuple) else a
        b = b[0] if isinstance(b, tuple) else b
        assert a.shape[0] == 1 and b.shape[0] == 1
    assert express_runs == []


def test_one_invoke_hands_over_as_a_trace_does(lm, hf_model, hf_tokenizer, arch, express_runs):
    """The invoke's body reads a module's input (not served by the express run: it hands
    over part-way) and edits an output; plain hooks give the reference."""
    ids = encode(hf_tokenizer, "the capital of france is")
    mask = torch.ones_like(ids)
    inputs, seen = [], []
    block = layers(hf_model, arch)[1]
    hooks = [block.register_forward_pre_hook(lambda m, a, kw: inputs.append(
                 (a[0] if a else kw["hidden_states"]).clone()), with_kwargs=True),
             layers(hf_model, arch)[0].mlp.register_forward_hook(lambda m, a, o: o * 2),
             hf_model.lm_head.register_forward_hook(lambda m, a, o: seen.append(o))]
    hooked_run(hf_model, hooks, ids, attention_mask=mask)
    for _ in range(4):
        with torch.no_grad(), lm.trace() as tracer:
            with tracer.invoke(ids, attention_mask=mask):
                mlp = layers(lm, arch)[0].mlp
                mlp.output = mlp.output * 2
                entering = layers(lm, arch)[1].inputs.save()
                logits = lm.lm_head.output.save()
        args, kwargs = entering
        entering = args[0] if args else kwargs["hidden_states"]
        assert torch.allclose(entering, inputs[0], atol=1e-6)
        assert torch.allclose(logits, seen[0], atol=1e-6)
    assert len(express_runs) >= 2


def test_an_error_in_one_invoke_is_raised_at_its_line(lm, arch):
    ids = torch.tensor([[5, 6, 7, 8]])
    for _ in range(4):
        with pytest.raises(ZeroDivisionError) as caught:
            with torch.no_grad(), lm.trace() as tracer:
                with tracer.invoke(ids):
                    h = layers(lm, arch)[0].output
                    1 / 0  # noqa: B018 - the body's own error
        frame = caught.traceback[-1]
        assert str(frame.path) == __file__ and "1 / 0" in str(frame.statement)


def test_one_invoke_of_a_plain_module_equals_a_hook():
    from interlace import Model

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    seen = []
    hook = module[1].register_forward_hook(lambda m, a, o: seen.append(o.clone()) or o + 1)
    try:
        with torch.no_grad():
            expected = module(x)
    finally:
        hook.remove()
    model = Model(module)
    for _ in range(4):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(x):
                relu = model[1].output.save()
                model[1].output = model[1].output + 1
                out = model.output.save()
        assert torch.equal(relu, seen[0]) and torch.allclose(out, expected)
