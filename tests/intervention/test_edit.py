"""`model.edit()`: recorded interventions every later run of the edited wrapper makes.

Reference: plain torch forward hooks doing the same edit on the same module. Every edit test
checks that the result equals the reference *and* differs from the unedited run, and that the
wrapper `edit()` was called on stays unedited.
"""

import gc
import pickle
import weakref

import pytest
import torch

import interlace
from interlace.intervention.edit import EditTracer, set_edits

from .helpers import assert_clean, hooked

IDS = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(11))
OTHER = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(12))


def layers(model, arch):
    """The decoder layers of either architecture (an Envoy or the plain module alike)."""
    return model.transformer.h if arch == "gpt2" else model.model.layers


@pytest.fixture(params=["gpt2", "llama"])
def arch(request):
    return request.param


@pytest.fixture
def module(arch, gpt2, llama):
    return gpt2 if arch == "gpt2" else llama


@pytest.fixture
def model(arch, gpt2_model, llama_model):
    return gpt2_model if arch == "gpt2" else llama_model


def run(module, ids=IDS, output=None):
    """The plain module's logits, with `output` ({submodule: fn}) forward hooks."""
    with torch.no_grad(), hooked(module, output=output or {}):
        return module(ids).logits


def double(module, args, out):
    return out * 2


def test_edit_applies_to_the_copy_and_leaves_the_original_clean(module, model, arch):
    with model.edit() as edited:
        layers(edited, arch)[0].mlp.output[:] = layers(edited, arch)[0].mlp.output * 2
    assert type(edited) is type(model) and edited is not model
    assert edited._module is model._module
    with torch.no_grad(), edited.trace(IDS):
        logits = edited.lm_head.output.save()
    with torch.no_grad(), model.trace(IDS):
        clean = model.lm_head.output.save()
    plain = run(module)
    assert torch.equal(logits, run(module, output={layers(module, arch)[0].mlp: double}))
    assert not torch.equal(logits, plain)
    assert torch.equal(clean, plain)
    assert torch.equal(run(module), plain)  # the module itself never changes
    assert_clean(module)


def test_tuple_form_binds_the_tracer_and_the_copy(module, model, arch):
    with model.edit() as (tracer, edited):
        for _ in tracer.iter[0]:
            layers(edited, arch)[1].output[:] = 0
    assert isinstance(tracer, EditTracer) and type(edited) is type(model)
    with torch.no_grad(), edited.trace(IDS):
        logits = edited.lm_head.output.save()
    zero = lambda m, a, out: torch.zeros_like(out)  # noqa: E731
    assert torch.equal(logits, run(module, output={layers(module, arch)[1]: zero}))
    assert not torch.equal(logits, run(module))


def test_inplace_edits_the_wrapper_and_clear_edits_removes_them(module, arch):
    model = interlace.Model(module)
    with model.edit(inplace=True) as tracer:
        layers(model, arch)[0].mlp.output[:] = layers(model, arch)[0].mlp.output * 2
    assert isinstance(tracer, EditTracer)
    with torch.no_grad(), model.trace(IDS):
        edited = model.lm_head.output.save()
    assert torch.equal(edited, run(module, output={layers(module, arch)[0].mlp: double}))
    assert not torch.equal(edited, run(module))
    model.clear_edits()
    with torch.no_grad(), model.trace(IDS):
        cleared = model.lm_head.output.save()
    assert torch.equal(cleared, run(module))


def test_edits_stack_in_program_order_with_each_other_and_the_trace(module, model, arch):
    with model.edit() as first:
        layers(first, arch)[0].mlp.output[:] = layers(first, arch)[0].mlp.output * 2
    with first.edit() as second:  # an edit of an edited copy keeps the first edit
        layers(second, arch)[0].mlp.output[:] = layers(second, arch)[0].mlp.output + 1
    mlp = layers(module, arch)[0].mlp
    with torch.no_grad(), second.trace(IDS):
        seen = layers(second, arch)[0].mlp.output.clone().save()  # after both edits
        layers(second, arch)[0].mlp.output[:] = layers(second, arch)[0].mlp.output * 3
        logits = second.lm_head.output.save()
    with torch.no_grad(), hooked(module, output={mlp: lambda m, a, o: (o * 2 + 1) * 3}):
        ref = module(IDS).logits
    assert torch.equal(logits, ref)
    with torch.no_grad(), hooked(module, output={mlp: lambda m, a, o: seen_ref.append(o * 2 + 1)}):
        seen_ref = []
        module(IDS)
    assert torch.equal(seen, seen_ref[0])
    with torch.no_grad(), first.trace(IDS):  # the first copy has only its own edit
        only_first = first.lm_head.output.save()
    assert torch.equal(only_first, run(module, output={mlp: double}))
    assert not torch.equal(only_first, logits)
    first.clear_edits()
    with torch.no_grad(), first.trace(IDS):
        none = first.lm_head.output.save()
    assert torch.equal(none, run(module))
    with torch.no_grad(), second.trace(IDS):  # clearing the first copy leaves the second alone
        still = second.lm_head.output.save()
    assert torch.equal(still, run(module, output={mlp: lambda m, a, o: o * 2 + 1}))


def test_names_are_bound_when_the_edit_is_recorded(module, model, arch):
    scale, layer = 2.0, 0
    with model.edit() as edited:
        layers(edited, arch)[layer].mlp.output[:] = layers(edited, arch)[layer].mlp.output * scale
    scale, layer = 100.0, 1  # noqa: F841 - later changes do not reach the recorded edit
    with torch.no_grad(), edited.trace(IDS):
        logits = edited.lm_head.output.save()
    assert torch.equal(logits, run(module, output={layers(module, arch)[0].mlp: double}))


def test_each_invoke_gets_the_edit_on_its_own_rows(module, model, arch):
    # `output[0]` is row 0 of the batch the edit sees: each invoke's own row 0, as alone
    with model.edit() as edited:
        layers(edited, arch)[0].output[0] = 0
    zero_row0 = lambda m, a, out: torch.cat([torch.zeros_like(out[:1]), out[1:]])  # noqa: E731
    two = torch.cat([OTHER, IDS])  # an invoke of two rows: only its first is zeroed
    with torch.no_grad(), edited.trace() as tracer:
        with tracer.invoke(IDS):
            a = edited.lm_head.output.save()
        with tracer.invoke(two):
            b = edited.lm_head.output.save()
    block = layers(module, arch)[0]
    torch.testing.assert_close(a, run(module, IDS, output={block: zero_row0}))
    ref_b = run(module, two, output={block: zero_row0})
    torch.testing.assert_close(b, ref_b)  # a batch of 3 rows may round differently
    assert not torch.allclose(b[0], ref_b[1])  # row 0 of the second invoke was edited, row 1 not
    torch.testing.assert_close(b[1], run(module, IDS)[0])
    assert not torch.allclose(a, run(module, IDS), atol=1e-3)


def test_a_direct_call_of_the_edited_wrapper_runs_the_edits(module, model, arch):
    with model.edit() as edited:
        layers(edited, arch)[0].mlp.output[:] = layers(edited, arch)[0].mlp.output * 2
    with torch.no_grad():
        direct = edited(IDS).logits
        unedited = model(IDS).logits
    assert torch.equal(direct, run(module, output={layers(module, arch)[0].mlp: double}))
    assert torch.equal(unedited, run(module))
    assert not torch.equal(direct, unedited)
    assert_clean(module)


def test_a_sweep_of_the_edited_wrapper_applies_the_edits_to_every_item(module, model, arch):
    with model.edit() as edited:
        layers(edited, arch)[0].mlp.output[:] = layers(edited, arch)[0].mlp.output * 2
    items = [IDS, OTHER, IDS.flip(1)]
    with torch.no_grad(), edited.sweep(items, batch_size=2, progress=False):
        logits = edited.lm_head.output.save()
    mlp = layers(module, arch)[0].mlp
    for item, value in zip(items, logits):
        torch.testing.assert_close(value, run(module, item, output={mlp: double}))
        assert not torch.allclose(value, run(module, item))
    assert_clean(module)


def test_an_edit_body_reads_values_of_the_run_it_is_replayed_in(module, model, arch):
    # the edit copies the first token's block-0 output over every position, per run
    with model.edit() as edited:
        h = layers(edited, arch)[0].output
        h[:] = h[:, :1]

    def broadcast(m, a, out):
        return out[:, :1].expand_as(out).clone()

    for ids in (IDS, OTHER):
        with torch.no_grad(), edited.trace(ids):
            logits = edited.lm_head.output.save()
        assert torch.equal(logits, run(module, ids, output={layers(module, arch)[0]: broadcast}))
        assert not torch.equal(logits, run(module, ids))


def test_an_edit_saves_nothing_back(model, arch):
    with model.edit() as edited:
        kept = layers(edited, arch)[0].output.save()
    with pytest.raises(UnboundLocalError):
        kept  # noqa: B018
    with torch.no_grad(), edited.trace(IDS):
        logits = edited.lm_head.output.save()
    assert logits.shape[:2] == IDS.shape
    with pytest.raises(UnboundLocalError):
        kept  # noqa: B018


# -- errors ------------------------------------------------------------------------------------


def test_an_error_in_an_edit_is_raised_by_the_trace_naming_the_edit(module, model, arch):
    line = test_an_error_in_an_edit_is_raised_by_the_trace_naming_the_edit.__code__.co_firstlineno
    with model.edit() as edited:
        layers(edited, arch)[0].mlp.output[:] = torch.ones(3)  # wrong shape: torch raises
    with pytest.raises(RuntimeError) as info:
        with torch.no_grad(), edited.trace(IDS):
            logits = edited.lm_head.output.save()  # noqa: F841
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"raised by the edit recorded at {__file__}:{line + 2}" in notes
    assert_clean(module)
    with torch.no_grad(), model.trace(IDS):  # the model is fine afterwards
        ok = model.lm_head.output.save()
    assert torch.equal(ok, run(module))


def test_edit_takes_no_backend(model):
    with pytest.raises(interlace.InterlaceError, match=r"model.edit\(backend=.*edits are recorded"):
        model.edit(backend=object())


def test_an_edit_not_used_as_a_with_block_is_refused(model):
    with pytest.raises(interlace.WithBlockNotFoundError, match="not used as a with block"):
        model.edit().__enter__()


def test_tracer_iter_outside_the_edit_body_is_an_error(model, arch):
    with model.edit() as (tracer, edited):
        layers(edited, arch)[0].output[:] = 0
    with pytest.raises(interlace.InterlaceError, match=r"tracer.iter of an edit works only inside"):
        tracer.iter[0]
    with pytest.raises(interlace.InterlaceError, match=r"tracer.all\(\) of an edit works only inside"):
        tracer.all()


# -- no cycles: the edited wrapper and its edits are freed by reference counting ---------------


def _edited_and_traced():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    module = GPT2LMHeadModel(config).eval()
    model = interlace.Model(module)
    refs = {"module": weakref.ref(module), "wrapper": weakref.ref(model)}
    # the edit bodies name the copy, the original wrapper and the tracer: all are kept by
    # the edits, none may make a cycle
    with model.edit() as (tracer, edited):
        for _ in tracer.iter[0]:
            edited.transformer.h[0].mlp.output[:] = 0
            model.transformer.h[1].output[:] = model.transformer.h[1].output * 2
    with edited.edit() as again:
        again.transformer.h[1].mlp.output[:] = 1
    with model.edit(inplace=True) as same:
        model.transformer.h[0].output[:] = 0
    refs.update(edited=weakref.ref(edited), again=weakref.ref(again), tracer=weakref.ref(tracer),
                same=weakref.ref(same))
    with torch.no_grad():
        with again.trace(IDS):
            a = again.lm_head.output.save()
        with again.trace() as batch:
            with batch.invoke(IDS):
                b = again.lm_head.output.save()
            with batch.invoke(OTHER):
                c = again.lm_head.output.save()
        d = again(IDS).logits
        with model.trace(IDS):
            e = model.lm_head.output.save()
    for name, value in dict(a=a, b=b, c=c, d=d, e=e).items():
        refs[name] = weakref.ref(value)
    return refs


def test_dropping_the_wrappers_frees_the_module_without_the_collector():
    _edited_and_traced()  # once first: what torch and transformers build lazily on first use
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        refs = _edited_and_traced()
        alive = sorted(name for name, ref in refs.items() if ref() is not None)
    finally:
        if enabled:
            gc.enable()
    assert not alive, f"still alive after the user let go (the collector is off): {alive}"


# -- edits travel to other processes (a Ray worker rebuilds the wrapper there) -------------------


def test_edits_pickle_and_apply_on_a_rebuilt_wrapper(module, model, arch):
    cloudpickle = pytest.importorskip("cloudpickle", reason="pickling module references needs cloudpickle")
    factor = torch.tensor(3.0)
    with model.edit() as (tracer, edited):
        for _ in tracer.iter[0]:
            layers(edited, arch)[0].mlp.output[:] = layers(edited, arch)[0].mlp.output * factor
    payload = cloudpickle.dumps((module, edited._edits))
    module2, edits = pickle.loads(payload)
    worker = set_edits(interlace.Model(module2), edits)
    with torch.no_grad(), worker.trace(IDS):
        logits = worker.lm_head.output.save()
    triple = lambda m, a, out: out * 3  # noqa: E731
    assert torch.equal(logits, run(module, output={layers(module, arch)[0].mlp: triple}))
    assert not torch.equal(logits, run(module))
