"""The engine's contract: one `Engine` per wrapped model, shared by its Envoys and tracers;
one run per model at a time (two threads take turns); batching and "how one run calls the
model" are strategies it is given; and no reference cycle keeps it or its model alive.

References are independent of the engine: the plain module run directly, and the order in
which the bodies of two threads' traces actually ran.
"""

import threading
import time
import weakref

import pytest
import torch

import interlace
from interlace import InterlaceError
from interlace.intervention import Engine
from interlace.intervention.batching import Batcher
from interlace.intervention.access import engine_of, module_of

from .memcheck import assert_freed


def test_one_engine_per_model_shared_by_its_envoys_tracers_and_edited_copies(gpt2):
    model = interlace.Model(gpt2)
    engine = engine_of(model)
    assert isinstance(engine, Engine) and engine.module is gpt2 and module_of(model) is gpt2
    envoys = [model.transformer, model.transformer.h[0], model.transformer.h[1].mlp, model.lm_head]
    assert all(engine_of(envoy) is engine for envoy in envoys)
    assert model.trace(torch.zeros(1, 4, dtype=torch.long)).engine is engine
    with model.edit() as edited:
        model.transformer.h[0].mlp.output[:] = 0
    assert edited is not model and engine_of(edited) is engine  # same model, its own edits
    # another wrapper of the same module is another model: its own engine
    assert engine_of(interlace.Model(gpt2)) is not engine


def test_two_threads_take_turns_on_one_model(mlp, x6):
    model = interlace.Model(mlp)
    engine = engine_of(model)
    inside, release = threading.Event(), threading.Event()
    order, results, errors = [], {}, []

    def first():
        try:
            with torch.no_grad(), model.trace(x6):
                h = model[2].output.save()
                order.append("first in")
                inside.set()
                release.wait(10)  # holds the model mid-forward (the body is parked here)
                order.append("first out")
            results["first"] = h
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            inside.set()

    def second():
        try:
            inside.wait(10)
            with torch.no_grad(), model.trace(x6 * 2):
                order.append("second in")
                h = model[2].output.save()
            results["second"] = h
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    inside.wait(10)
    time.sleep(0.3)  # room for the second trace to run ahead if nothing made it wait
    assert engine.owner == threads[0].ident and order == ["first in"]
    release.set()
    for thread in threads:
        thread.join(20)
    assert not errors, errors
    assert order == ["first in", "first out", "second in"]
    with torch.no_grad():
        assert torch.equal(results["first"], mlp[:3](x6))
        assert torch.equal(results["second"], mlp[:3](x6 * 2))
    assert engine.running is None and engine.owner is None and not engine.lock.locked()


def test_a_trace_of_the_model_inside_its_own_body_is_an_error(mlp, x6):
    model = interlace.Model(mlp)
    with pytest.raises(InterlaceError, match="already being traced in this thread"):
        with torch.no_grad(), model.trace(x6):
            with model.trace(x6):
                model[0].output.save()
    assert not engine_of(model).lock.locked()


def _nested_in_threads(orders, cases, together):
    """Thread i traces orders[i][0] and, in its body, orders[i][1]. `cases`: model -> (input,
    body reading one value and returning it saved). together="outer": every thread holds
    its outer model before any starts its inner trace; "start": they start together.
    Returns ({thread: {model: value}}, {thread: error}, {thread: seconds from its inner
    trace's start to its error}); fails, rather than hangs, if a thread is stuck."""
    met = threading.Barrier(len(orders), timeout=10)
    results, errors, waited, starts = {}, {}, {}, {}

    def work(i):
        first, second = orders[i]
        (x, read), (y, read_second) = cases[first], cases[second]
        try:
            if together == "start":
                met.wait()
            with torch.no_grad(), first.trace(x):
                a = read(first)
                if together == "outer":
                    met.wait()
                starts[i] = time.perf_counter()  # a mutation: the body's locals stay its own
                with second.trace(y):
                    b = read_second(second)
            results[i] = {first: a, second: b}
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors[i] = error
            if i in starts:
                waited[i] = time.perf_counter() - starts[i]

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(orders))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 15
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "nested traces in several threads hang"
    return results, errors, waited


@pytest.fixture
def two_models(mlp, gpt2, x6):
    """An MLP and GPT-2 `Model`, each with its input, body and plain-torch reference."""
    tokens = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(3))
    small, big = interlace.Model(mlp), interlace.Model(gpt2)
    cases = {small: (x6, lambda m: m[2].output.save()),
             big: (tokens, lambda m: m.lm_head.output.save())}
    with torch.no_grad():
        expected = {small: mlp[:3](x6), big: gpt2(tokens).logits}
    return small, big, cases, expected


def _check_one_raised_the_rest_ran(results, errors, waited, expected, names):
    """Exactly one thread got the deadlock error, naming every model, within a second; every
    other thread ran, with plain torch's values; no model is left taken."""
    assert len(errors) == 1 and len(results) == len(expected) - 1, (errors, results)
    [(loser, error)] = errors.items()
    assert isinstance(error, InterlaceError), repr(error)
    message = str(error)
    assert message.startswith("deadlock: ") and "same order" in message
    assert all(name in message for name in names), message
    assert waited[loser] < 1.0
    for values in results.values():
        for model, value in values.items():
            torch.testing.assert_close(value, expected[model], rtol=0, atol=0)
    for model in expected:
        engine = engine_of(model)
        assert engine.owner is None and not engine.lock.locked()


def test_nested_traces_in_opposite_orders_in_two_threads_raise_instead_of_hanging(two_models):
    """Thread 0: MLP trace, GPT-2 trace in its body; thread 1: GPT-2 then MLP. Each holds one
    model and waits for the other: one of them raises an InterlaceError naming both models
    (within a second), and the other one runs and gets plain torch's values."""
    small, big, cases, expected = two_models
    outcome = _nested_in_threads([(small, big), (big, small)], cases, together="outer")
    _check_one_raised_the_rest_ran(*outcome, expected, ["Sequential", "GPT2LMHeadModel"])


def test_a_wait_cycle_through_three_threads_raises_instead_of_hanging(x6):
    models = []
    for width in (5, 7, 9):  # three classes-alike models told apart by their modules
        torch.manual_seed(width)
        models.append(interlace.Model(torch.nn.Sequential(torch.nn.Linear(6, width)).eval()))
    cases = {m: (x6, lambda m: m[0].output.save()) for m in models}
    with torch.no_grad():
        expected = {m: engine_of(m).module(x6) for m in models}
    outcome = _nested_in_threads([(models[i], models[(i + 1) % 3]) for i in range(3)], cases,
                                 together="outer")
    _check_one_raised_the_rest_ran(*outcome, expected,
                                   [f"{id(engine_of(m).module):#x}" for m in models])


def test_nested_traces_in_the_same_order_in_two_threads_both_run(two_models):
    small, big, cases, expected = two_models
    results, errors, _ = _nested_in_threads([(small, big), (small, big)], cases,
                                            together="start")
    assert not errors, errors
    assert sorted(results) == [0, 1]
    for values in results.values():
        for model, value in values.items():
            torch.testing.assert_close(value, expected[model], rtol=0, atol=0)


class _Recording(Batcher):
    """The default batching, recording what the engine asks of it."""

    as_given = False  # even one invoke goes through prepare/batch

    def __init__(self):
        self.calls = []

    def prepare(self, args, kwargs):
        self.calls.append("prepare")
        return super().prepare(args, kwargs)

    def batch(self, prepared):
        self.calls.append(f"batch {len(prepared)}")
        return super().batch(prepared)


def test_the_engine_uses_the_strategies_it_is_given(mlp, x6):
    default = _Recording()
    engine = Engine(mlp, batcher=default)
    seen = {}
    runs = []

    def body():  # reads module 3's output (named_modules order: root, "0", "1", "2", ...)
        seen["h"] = engine.active().read(2 * 3 + 1)

    def run(x):
        runs.append(tuple(x.shape))
        return mlp(x) * 2

    with torch.no_grad():
        # the engine's own batcher, and a run that is not the module
        out = engine.interleave([(body, (x6,), {})], run=run)
        assert default.calls == ["prepare", "batch 1"] and runs == [(3, 6)]
        assert torch.equal(out, mlp(x6) * 2) and torch.equal(seen["h"], mlp[:3](x6))
        # a batcher passed for one run wins over the engine's; two invokes are one batch
        other = _Recording()
        halves = []

        def read():  # each invoke's body sees its own rows
            halves.append(engine.active().read(2 * 3 + 1))

        out = engine.interleave([(read, (x6[:1],), {}), (read, (x6[1:],), {})], batcher=other)
        assert other.calls == ["prepare", "prepare", "batch 2"] and default.calls == ["prepare", "batch 1"]
        assert torch.equal(out, mlp(x6))
        whole = mlp[:3](x6)  # the batch's rows (a batched matmul is not bitwise a row's own)
        assert torch.equal(halves[0], whole[:1]) and torch.equal(halves[1], whole[1:])


def test_an_engine_and_its_model_are_freed_by_reference_counting(x6):
    def run():
        module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model = interlace.Model(module)
        for _ in range(2):
            with torch.no_grad(), model.trace(x6):
                h = model[1].output.save()
        layer = model[2]  # a child Envoy holds the engine, not its root
        return {"module": weakref.ref(module), "wrapper": weakref.ref(model),
                "engine": weakref.ref(engine_of(layer)), "envoy": weakref.ref(layer),
                "h": weakref.ref(h)}

    assert_freed(run)
