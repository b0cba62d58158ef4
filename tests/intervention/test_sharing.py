"""When a run shares variables between invokes (`sharing.shares`), and that turning it off
for bodies that take nothing from each other changes no result."""

from types import SimpleNamespace

import torch

from interlace.intervention.sharing import shares

from .helpers import hooked


def _bodies(*specs):
    """Mediator stand-ins: each spec is (assigns, takes) of its body's job."""
    return [SimpleNamespace(fn=SimpleNamespace(assigns=a, takes=t)) for a, t in specs]


def test_shares_only_when_a_later_body_may_take_a_name():
    names = frozenset({"h"})
    none = frozenset()
    assert not shares(_bodies((names, none)))  # one body
    assert not shares(_bodies((names, none), (names, none), (names, none)))
    assert shares(_bodies((names, none), (names, none), (none, names)))
    assert shares(_bodies((names, None), (names, None)))  # unknown: assume it may
    # the first binder takes from nobody, whatever its `takes` says
    assert not shares(_bodies((names, names), (names, none)))
    # a model's edit (no `assigns`) neither binds nor takes
    edit = SimpleNamespace(fn=SimpleNamespace())
    assert not shares([edit, *_bodies((names, none))])


def test_invokes_that_take_nothing_equal_plain_hooks_per_row(mlp, mlp_model):
    """Every invoke assigns the same names and reads none of another's: no sharing, and each
    invoke still sees and edits only its own rows, as a plain hook on that row alone does."""
    xs = [torch.randn(1, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    outs = []
    with torch.no_grad():
        with mlp_model.trace() as tracer:
            for x in xs:
                with tracer.invoke(x):
                    h = mlp_model[1].output.clone().save()
                    mlp_model[1].output = h * 2
                    outs.append(mlp_model.output.save())
    expected_h, expected_out = [], []
    for x in xs:
        seen = {}

        def double(module, args, out, seen=seen):
            seen["h"] = out.clone()
            return out * 2

        with torch.no_grad(), hooked(mlp, output={mlp[1]: double}):
            expected_out.append(mlp(x))
        expected_h.append(seen["h"])
    # a batched matmul may round differently from a one-row one: 1e-6, as test_invoke
    assert torch.allclose(h, expected_h[-1], atol=1e-6)  # as inline: the last invoke's `h`
    assert len(outs) == len(xs)
    for got, want, x in zip(outs, expected_out, xs):
        assert torch.allclose(got, want, atol=1e-6)
        with torch.no_grad():
            assert not torch.allclose(got, mlp(x), atol=1e-3)  # the edit changed the result
