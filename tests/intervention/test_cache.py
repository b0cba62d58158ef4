"""`tracer.cache(...)`: every module's values as the model passed them on, against plain hooks.

The reference is a forward hook (and a with-kwargs pre-hook for inputs) on every module of the
plain model, keeping a detached clone of each tensor, in the order the hooks fire. Edits are
made by plain hooks registered before the capturing ones.
"""

import weakref

import pytest
import torch

import interlace
from interlace import InterlaceError
from interlace.intervention.cache import Cache, CacheError

from .helpers import assert_clean, hooked
from .memcheck import assert_freed, collector_off, watch

IDS = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(11))


def _snap(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_snap(v) for v in value) if not hasattr(value, "_fields") else value
    if isinstance(value, dict):
        return {k: _snap(v) for k, v in value.items()}
    return value


def plain_capture(module, ids, edits=None, inputs=False):
    """{path: [output per call]} (and {path: [(args, kwargs) per call]}) by plain hooks."""
    outputs, ins = {}, {}

    def post(path):
        def hook(mod, args, out):
            outputs.setdefault(path, []).append(_snap(out))

        return hook

    def pre(path):
        def hook(mod, args, kwargs):
            ins.setdefault(path, []).append((_snap(args), _snap(kwargs)))

        return hook

    named = {("model." + n if n else "model"): m for n, m in module.named_modules()}
    with hooked(module, output=edits or {}):
        with hooked(module, output={m: post(p) for p, m in named.items()},
                    pre={m: pre(p) for p, m in named.items()} if inputs else None):
            with torch.no_grad():
                result = module(ids)
    return outputs, ins, result


def same(a, b):
    """Tensors equal bitwise; tuples/lists/dicts item by item; other objects by type."""
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and torch.equal(a, b)
    if isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in b)
    return type(a) is type(b)


@pytest.fixture(params=["gpt2", "llama"])
def arch(request, gpt2, llama, gpt2_model, llama_model):
    return (gpt2, gpt2_model) if request.param == "gpt2" else (llama, llama_model)


def test_every_module_equals_plain_hooks(arch):
    module, model = arch
    with torch.no_grad(), model.trace(IDS) as tracer:
        cache = tracer.cache()
    want, _, result = plain_capture(module, IDS)
    assert isinstance(cache, Cache)
    assert list(cache) == list(want)  # the modules that ran, in the order they finished
    assert len(cache) == len(want) > 20 and "model" in cache
    for path, outs in want.items():
        assert len(outs) == 1
        assert same(cache[path].output, outs[0]), path
    assert torch.equal(cache["model"].output.logits, result.logits)
    assert_clean(module)


def test_inputs_equal_plain_pre_hooks(arch):
    module, model = arch
    with torch.no_grad(), model.trace(IDS) as tracer:
        cache = tracer.cache(include_inputs=True)
    want_out, want_in, _ = plain_capture(module, IDS, inputs=True)
    assert set(cache) == set(want_in)
    for path, calls in want_in.items():
        args, kwargs = cache[path].inputs
        assert same(args, calls[0][0]) and same(kwargs, calls[0][1]), path
        assert same(cache[path].output, want_out[path][0]), path
    layer = (model.transformer.h[1] if hasattr(module, "transformer") else model.model.layers[1])
    view = cache[layer._path]
    first = view.inputs[0][0] if view.inputs[0] else next(iter(view.inputs[1].values()))
    assert torch.equal(view.input, first)  # the first positional, else first keyword argument


def test_values_are_after_this_traces_edits(gpt2, gpt2_model):
    mlp = gpt2.transformer.h[0].mlp
    with torch.no_grad(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache()
        gpt2_model.transformer.h[0].mlp.output = gpt2_model.transformer.h[0].mlp.output * 2
        gpt2_model.transformer.h[1].mlp.skip(torch.zeros(2, 8, 64))
    # the same edits by plain hooks (a skipped module's output is the value given)
    want, _, _ = plain_capture(gpt2, IDS, edits={
        mlp: lambda m, a, o: o * 2,
        gpt2.transformer.h[1].mlp: lambda m, a, o: torch.zeros_like(o),
    })
    plain, _, _ = plain_capture(gpt2, IDS)
    assert "model.transformer.h.1.mlp.c_fc" not in cache  # skipped: its insides never ran
    for path in ("model.transformer.h.0.mlp", "model.transformer.h.1.mlp", "model.transformer.h.1",
                 "model.lm_head"):
        assert same(cache[path].output, want[path][0]), path
        assert not same(cache[path].output, plain[path][0]), path  # the edit changed it
    assert same(cache["model.transformer.h.0.mlp.c_proj"].output,
                plain["model.transformer.h.0.mlp.c_proj"][0])  # before the edit: unchanged


def test_a_later_in_place_edit_does_not_reach_back(gpt2, gpt2_model):
    """GPT-2's MLP returns its c_proj's very tensor (dropout is the identity in eval): zeroing
    mlp.output in place zeroes that tensor, after c_proj ran. Its cache entry is the snapshot
    taken when c_proj ran, as a cloning plain hook has it (nnsight, on CPU, keeps the live
    tensor and shows zeros there)."""
    mlp = gpt2.transformer.h[0].mlp

    def zero(m, a, o):
        o[:] = 0

    with torch.no_grad(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache(modules=["model.transformer.h.0.mlp.c_proj", "model.transformer.h.0.mlp"])
        gpt2_model.transformer.h[0].mlp.output[:] = 0
    want, _, _ = plain_capture(gpt2, IDS, edits={mlp: zero})
    c_proj = cache.model.transformer.h[0].mlp.c_proj.output
    assert same(c_proj, want["model.transformer.h.0.mlp.c_proj"][0]) and c_proj.abs().sum() > 0
    assert cache.model.transformer.h[0].mlp.output.abs().sum() == 0


def test_modules_by_envoy_path_short_path_and_module(arch):
    module, model = arch
    layers = model.transformer.h if hasattr(module, "transformer") else model.model.layers
    last = layers[1]
    with torch.no_grad(), model.trace(IDS) as tracer:
        cache = tracer.cache(modules=[layers[0], last._path, last._path[len("model."):],
                                      module.lm_head])
    assert list(cache) == [layers[0]._path, last._path, "model.lm_head"]
    want, _, _ = plain_capture(module, IDS)
    for path in cache:
        assert same(cache[path].output, want[path][0])
    with torch.no_grad(), model.trace(IDS) as tracer:
        blocks = tracer.cache(modules=layers)  # a container Envoy: its children
    assert list(blocks) == [layers[0]._path, layers[1]._path]


def test_a_container_stands_for_its_children_however_it_is_named(arch):
    """`modules=` naming a ModuleList (an Envoy or a path, alone or in a list) records its
    layers, as plain hooks on each layer capture them; a container of containers, its leaves."""
    module, model = arch
    if hasattr(module, "transformer"):
        layers, path = model.transformer.h, "transformer.h"
    else:
        layers, path = model.model.layers, "model.layers"
    want, _, _ = plain_capture(module, IDS)
    expected = [layers[0]._path, layers[1]._path]
    for modules in ([layers], [path], ["model." + path], path, layers, [layers, path]):
        with torch.no_grad(), model.trace(IDS) as tracer:
            cache = tracer.cache(modules=modules)
        assert list(cache) == expected, modules
        for key in expected:
            assert same(cache[key].output, want[key][0]), (modules, key)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleDict({
                "a": torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Tanh()]),
                "b": torch.nn.ModuleList([torch.nn.Linear(4, 4)]),
            })

        def forward(self, x):
            for group in self.blocks.values():
                for layer in group:
                    x = layer(x)
            return x

    net = Net()
    x = torch.randn(2, 4)
    want, _, _ = plain_capture(net, x)
    nested = interlace.Model(net)
    with torch.no_grad(), nested.trace(x) as tracer:
        cache = tracer.cache(modules=["blocks"])
    assert list(cache) == ["model.blocks.a.0", "model.blocks.a.1", "model.blocks.b.0"]
    for key in cache:
        assert same(cache[key].output, want[key][0]), key


def test_navigation_forms(gpt2, gpt2_model):
    with torch.no_grad(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache()
    value = cache["model.transformer.h.1.mlp"].output
    assert cache.model.transformer.h[1].mlp.output is value
    assert cache.transformer.h[-1].mlp.output is value
    assert cache["transformer.h.1.mlp"].output is value
    assert cache.model.transformer.h["1"].mlp.output is value
    assert [v.path for v in cache.model.transformer.h] == ["model.transformer.h.0", "model.transformer.h.1"]
    assert "mlp" in cache.model.transformer.h[1] and "model.transformer.h.1.mlp" in cache
    assert "model.transformer.h" not in cache  # a ModuleList never runs: nothing recorded
    keys = cache.model.transformer.h[1].keys()
    assert "model.transformer.h.1" in keys and "model.transformer.h.1.mlp.c_fc" in keys
    assert all(k.startswith("model.transformer.h.1") for k in keys)
    assert len(cache.model.transformer.h[1].mlp) == 1
    assert dict(cache.items())["model.lm_head"].output is cache.model.lm_head.output


def test_a_cache_pickles_without_its_model(gpt2_model):
    import io

    with torch.no_grad(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache(modules=gpt2_model.transformer.h)
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert list(loaded) == list(cache)
    assert torch.equal(loaded.model.transformer.h[1].output, cache.model.transformer.h[1].output)


def test_a_module_called_twice_gives_a_list(mlp):
    shared = torch.nn.Linear(6, 6)
    module = torch.nn.Sequential(shared, torch.nn.ReLU(), shared).eval()
    model = interlace.Model(module)
    x = torch.randn(2, 6)
    with torch.no_grad(), model.trace(x) as tracer:
        cache = tracer.cache()
    want, _, _ = plain_capture(module, x)
    path = "model.0"  # the shared Linear has one path, visited twice
    assert len(cache[path]) == 2 and same(cache[path].output, want[path])


def test_options_dtype_detach_device(gpt2, gpt2_model):
    with gpt2_model.trace(IDS) as tracer:  # grad enabled: outputs require grad
        plain = tracer.cache(modules=["model.transformer.h.0"])
        kept = tracer.cache(modules=["model.transformer.h.0"], detach=False, dtype=torch.float64,
                            device=None)
    a, b = plain.model.transformer.h[0].output, kept.model.transformer.h[0].output
    assert not a.requires_grad and a.dtype == torch.float32
    assert b.requires_grad and b.dtype == torch.float64 and torch.equal(a.double(), b.detach())


def test_invokes_cache_their_own_rows_as_if_alone(gpt2, gpt2_model):
    with torch.no_grad(), gpt2_model.trace() as tracer:
        with tracer.invoke(IDS[:1]):
            first = tracer.cache(modules=[gpt2_model.transformer.h[1]])
        with tracer.invoke(IDS[1:]):
            second = tracer.cache(modules=[gpt2_model.transformer.h[1]], include_inputs=True)
            gpt2_model.transformer.h[0].output[:] = 0
    for cache, ids, edits in ((first, IDS[:1], None),
                              (second, IDS[1:], {gpt2.transformer.h[0]: lambda m, a, o: o * 0})):
        want, _, _ = plain_capture(gpt2, ids, edits=edits)
        got = cache.model.transformer.h[1].output
        assert got.shape[0] == 1
        torch.testing.assert_close(got, want["model.transformer.h.1"][0], rtol=1e-5, atol=1e-5)
    assert second.model.transformer.h[1].input.abs().sum() == 0  # its input: h[0], zeroed


def test_errors(gpt2_model):
    with pytest.raises(CacheError, match=r"'transformer\.h\.7' is not a module path") as info:
        with gpt2_model.trace(IDS) as tracer:
            tracer.cache(modules=["transformer.h.7"])
    assert isinstance(info.value, ValueError) and isinstance(info.value, InterlaceError)
    with pytest.raises(CacheError, match="takes Envoys .* or module paths"):
        with gpt2_model.trace(IDS) as tracer:
            tracer.cache(modules=[torch.nn.Linear(2, 2)])
    with pytest.raises(CacheError, match="must be called before the body reads or edits"):
        with gpt2_model.trace(IDS) as tracer:
            h = gpt2_model.transformer.h[0].output  # noqa: F841
            tracer.cache()
    with pytest.raises(CacheError, match="call it inside the body that runs with the model"):
        with gpt2_model.trace() as tracer:
            tracer.cache()
            with tracer.invoke(IDS):
                pass
    with torch.no_grad(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache(modules=[gpt2_model.lm_head])
    with pytest.raises(CacheError, match=r"include_inputs=True"):
        cache.model.lm_head.inputs  # noqa: B018
    with pytest.raises(KeyError, match="was not cached"):
        cache.model.transformer.h[0].output  # noqa: B018
    with pytest.raises(AttributeError, match="has no submodule 'nope'"):
        cache.model.transformer.nope  # noqa: B018
    with pytest.raises(KeyError, match="is not a module path"):
        cache["model.nope"]  # noqa: B018
    assert "model.nope" not in cache and "model.transformer.h.0" not in cache


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2,
                                      n_head=4, bos_token_id=0, eos_token_id=0)).eval()


def test_cache_outlives_the_model_without_holding_it():
    """A saved cache holds no Envoy, module or interleaver: dropping the model frees it by
    reference counting alone (collector off), while the cache stays readable."""

    def traced():
        module = _gpt2()
        model = interlace.Model(module)
        with model.trace(IDS) as tracer:
            cache = tracer.cache(include_inputs=True)
        return cache, [weakref.ref(module), weakref.ref(model)]

    traced()  # transformers' lazy first-use state is made outside the check
    with collector_off():
        cache, refs = traced()
        assert [r() for r in refs] == [None, None]
        assert cache.model.transformer.h[0].output.shape == (2, 8, 64)
        assert cache.transformer.h[1].mlp.output.shape == (2, 8, 64)


def test_a_run_with_a_cache_is_freed_by_refcounting():
    def run():
        module = _gpt2()
        model = interlace.Model(module)
        refs = {"module": weakref.ref(module), "wrapper": weakref.ref(model)}
        for _ in range(2):
            with model.trace(IDS) as tracer:
                cache = tracer.cache(include_inputs=True)
            watch(refs, "cached", cache.model.transformer.h[0].output)
        return refs

    assert_freed(run)


def test_unchanged_tensors_share_one_copy_changed_ones_do_not(gpt2, gpt2_model):
    """GPT-2's mlp.c_proj, mlp.dropout and mlp output one tensor: one copy serves all three,
    until an in-place edit changes it (then the later entries get a copy of their own)."""
    with torch.no_grad(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache()
    mlp = cache.model.transformer.h[0].mlp
    assert mlp.c_proj.output is mlp.dropout.output is mlp.output
    with torch.no_grad(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache()
        gpt2_model.transformer.h[0].mlp.dropout.output[:, 0] = 0
    mlp = cache.model.transformer.h[0].mlp
    assert mlp.dropout.output is mlp.output and mlp.c_proj.output is not mlp.output
    assert mlp.c_proj.output[:, 0].abs().sum() > 0 and mlp.output[:, 0].abs().sum() == 0


def test_inference_mode(gpt2, gpt2_model):
    with torch.inference_mode(), gpt2_model.trace(IDS) as tracer:
        cache = tracer.cache(modules=[gpt2_model.transformer.h[1], gpt2_model.lm_head])
    want, _, _ = plain_capture(gpt2, IDS)
    assert same(cache.model.lm_head.output, want["model.lm_head"][0])
