"""The per-trace steps a body's first lines pay for (issue 20): making the tracer, `h[i]`.

Each is checked twice: what it gives (the same as before, against the modules themselves
and against plain hooks), and that the warm step does no per-call work it need not do.
"""

import sys

import pytest
import torch

import interlace
from interlace.intervention.tracer import InterleavingTracer
from interlace.tracing import Tracer


def _hooked(module, ids, sub):
    """`sub`'s output in a plain forward of `module` (a torch hook: the reference)."""
    seen = []
    handle = sub.register_forward_hook(lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            module(ids)
    finally:
        handle.remove()
    return seen[0]


def _python_frames(fn, *args):
    """`fn(*args)` and the names of the Python frames it ran, in call order."""
    frames = []

    def profile(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, frames


# -- making the tracer ---------------------------------------------------------------------

def test_a_trace_with_inputs_makes_only_its_own_fields(gpt2, ids):
    """`model.trace(x)` stores the model and its engine; the defaults every trace shares and
    the invoke lists (only `model.trace()` with invokes needs them) are not made per trace."""
    model = interlace.Model(gpt2)
    tracer = model.trace(ids)
    per_trace = {"model", "engine", "_run", "_batcher"} | {"args", "kwargs", "backend"}  # (the twin's TracerBase fields)
    assert set(tracer.__dict__) <= per_trace
    assert tracer.args == (ids,) and tracer.kwargs == {} and tracer._run is None
    with tracer:
        out = model.transformer.h[0].output.save()
    torch.testing.assert_close(out, _hooked(gpt2, ids, gpt2.transformer.h[0]))
    assert tracer.model is None and tracer.args == () and tracer.kwargs == {}


def test_making_a_tracer_runs_no_python_frame_but_its_own(gpt2, ids):
    """`model.trace(x)` runs no Python frame natively (`hotpath.tracer_maker` makes the
    tracer); the twin runs its one closure (its TracerBase.__init__ was once a third frame,
    `Model.trace` and `InterleavingTracer.__init__` the first two)."""
    model = interlace.Model(gpt2)
    model.trace(ids).release()
    tracer, frames = _python_frames(model.trace, ids)
    tracer.release()
    assert frames == ([] if interlace.native else ["trace"])


def test_tracer_fields_are_as_tracerbase_init_stores_them(gpt2, ids):
    """Keywords are copied (the caller's dict is not kept), `backend` among them is refused as
    before, and a subclass whose MRO puts another `__init__` before TracerBase's reaches it."""
    model = interlace.Model(gpt2)
    given = {"attention_mask": torch.ones_like(ids)}
    tracer = InterleavingTracer(model, (ids,), given)
    assert tracer.kwargs == given and tracer.kwargs is not given
    given.clear()
    assert list(tracer.kwargs) == ["attention_mask"]
    with pytest.raises(TypeError, match="multiple values for keyword argument 'backend'"):
        InterleavingTracer(model, (ids,), {"backend": None})

    calls = []

    class Mixin(Tracer):
        def __init__(self, *args, **kwargs):
            calls.append(args)
            super().__init__(*args, **kwargs)

    class Mine(InterleavingTracer, Mixin):
        pass

    with model.trace(ids, tracer_cls=Mine):
        out = model.transformer.h[1].output.save()
    assert calls == [(ids,)]
    torch.testing.assert_close(out, _hooked(gpt2, ids, gpt2.transformer.h[1]))


def test_invokes_after_a_trace_with_inputs_still_collect(gpt2, ids):
    """The invoke lists are made by each `model.trace()`: two in a row batch their own."""
    model = interlace.Model(gpt2)
    with model.trace(ids):
        model.transformer.h[0].output.save()
    for _ in range(2):
        with model.trace() as tracer:
            with tracer.invoke(ids[:1]):
                a = model.transformer.h[0].output.save()
            with tracer.invoke(ids[1:]):
                b = model.transformer.h[0].output.save()
        torch.testing.assert_close(a, _hooked(gpt2, ids[:1], gpt2.transformer.h[0]))
        torch.testing.assert_close(b, _hooked(gpt2, ids[1:], gpt2.transformer.h[0]))
        assert tracer._invokes == [] and tracer._invoke_assigns == set()



def test_an_invoke_is_made_as_the_python_method_makes_it_with_no_python_frame(gpt2, ids):
    """`tracer.invoke(x)` with no keyword is made by `hotpath.invoker_maker` (natively no
    Python frame; the twin runs its one closure); the method it stands for (`__wrapped__`,
    what every other call runs) makes the same Invoker: same class, the same fields in the
    same order, the same values. The maker's refusals are the method's."""
    from interlace.errors import InterlaceError

    model = interlace.Model(gpt2)
    made = []
    for _ in range(2):
        with model.trace() as tracer:
            fast, frames = _python_frames(tracer.invoke, ids)
            slow = type(tracer).invoke.__wrapped__(tracer, ids)
            made.append((fast, slow, frames))
            with tracer.invoke(ids):  # (one entered beside the two made: it alone runs)
                h = model.transformer.h[0].output.save()
        torch.testing.assert_close(h, _hooked(gpt2, ids, gpt2.transformer.h[0]))
    for fast, slow, frames in made:
        assert frames == ([] if interlace.native else ["invoke"])
        assert type(fast) is type(slow)
        assert list(vars(fast)) == list(vars(slow))
        assert fast.parent is slow.parent and fast.backend is slow.backend
        assert fast._deferred is slow._deferred is None
        assert fast.args == slow.args and fast.args[0] is ids and fast.kwargs == slow.kwargs == {}
    with pytest.raises(InterlaceError, match="works only as `with tracer.invoke"):
        tracer.invoke(ids)  # (the trace has ended: it collects no more)
    with pytest.raises(InterlaceError, match="this trace already has inputs"):
        with model.trace(ids) as traced:
            traced.invoke(ids)


# -- `envoy[i]` ----------------------------------------------------------------------------

class _Counted(torch.nn.Identity):
    """A module that counts how often it is compared (`==`) with anything."""

    compared = 0

    def __eq__(self, other):
        type(self).compared += 1
        return self is other

    __hash__ = torch.nn.Identity.__hash__


def test_index_does_not_compare_every_slot_per_call():
    """A warm `h[i]` finds its slot without comparing each slot's module (with None) on every
    call: 48 layers cost 48 comparisons per index before."""
    layers = torch.nn.ModuleList([_Counted() for _ in range(48)])
    model = interlace.Model(torch.nn.Sequential(layers))
    h = model[0]
    assert h[5]._module is layers[5]
    _Counted.compared = 0
    for i in range(-48, 48):
        assert h[i]._module is layers[i]
    assert _Counted.compared == 0


@pytest.mark.native_only
def test_a_warm_index_runs_no_python_frame():
    """A warm `h[i]` is served by the compiled indexer (`hotpath.envoy_indexer`) with no
    Python frame; a first `h[i]` (its Envoy not made yet) and a miss go to the Python
    method, which makes and explains."""
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    model = interlace.Model(torch.nn.Sequential(layers))
    h = model[0]
    frames = []

    def profile(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_name)

    def indexed(i):
        frames.clear()
        sys.setprofile(profile)
        try:
            return h[i]
        finally:
            sys.setprofile(None)

    assert indexed(1)._module is layers[1] and "_getitem" in frames  # made now
    assert indexed(1)._module is layers[1] and indexed(-2)._module is layers[1]
    assert frames == []
    with pytest.raises(IndexError, match=r"has 3 submodule\(s\); index 3 is out of range"):
        indexed(3)
    assert "_getitem" in frames


def test_an_envoy_class_of_its_own_keeps_its_own_index():
    """An Envoy subclass (`envoys=`) that defines `__getitem__` is the one called; one that
    calls `super().__getitem__` gets the same child Envoys as a plain Envoy."""
    calls = []

    class Counting(interlace.Envoy):
        def __getitem__(self, key):
            calls.append(key)
            return super().__getitem__(key)

    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    model = interlace.Model(torch.nn.Sequential(layers), envoys={torch.nn.ModuleList: Counting})
    h = model[0]
    assert type(h) is Counting
    assert [h[i]._module for i in (0, 1, 2, -1)] == [layers[0], layers[1], layers[2], layers[2]]
    assert h[1] is h[1] and calls == [0, 1, 2, -1, 1, 1]


@pytest.mark.parametrize("container", [torch.nn.ModuleList, torch.nn.Sequential])
def test_index_follows_every_edit_of_the_container(container):
    """After each edit torch offers (append, insert, delete, a slot emptied and filled again),
    `h[i]` is the Envoy of the name the container's non-empty slots have at `i` now."""
    def fresh():
        return torch.nn.Linear(2, 2)

    slots = [fresh(), fresh(), fresh()]
    layers = torch.nn.ModuleList(slots) if container is torch.nn.ModuleList else container(*slots)
    model = interlace.Model(torch.nn.Sequential(layers))
    h = model[0]

    def check():
        names = [n for n, m in layers._modules.items() if m is not None]
        # h[i] is the Envoy of the i-th non-empty slot's name (kept by name, as `h["1"]`)
        assert [h[i] for i in range(len(names))] == [h[name] for name in names]
        assert [h[i] for i in range(-len(names), 0)] == [h[name] for name in names]
        assert list(h) == [h[name] for name in names]
        with pytest.raises(IndexError, match=rf"has {len(names)} submodule\(s\)"):
            h[len(names)]

    check()
    layers.append(fresh())
    check()
    layers.insert(1, fresh())
    check()
    del layers[0]
    check()
    layers.register_module("1", None)  # a slot emptied: later slots move down
    check()
    layers.register_module("1", fresh())  # filled again
    check()


def test_index_of_a_plain_module_follows_renames():
    """A plain module's children (no renumbering container): names listed per call."""
    module = torch.nn.Module()
    module.a = torch.nn.Linear(2, 2)
    module.b = torch.nn.Linear(2, 2)
    model = interlace.Model(module)
    assert model[0]._module is module.a
    a = module.a
    del module.a
    module.a = a  # same name, same module, now last
    assert model[0]._module is module.b and model[1]._module is a
