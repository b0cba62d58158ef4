"""The Envoy API scripts use (nnsight 0.8's names), and aliases (`rename=`).

References are the plain modules themselves (torch's named_modules, parameters, devices)
and plain forward hooks for values read through aliases.
"""

import gc
import weakref

import pytest
import torch

import interlace
from interlace import Envoy, NotInTraceError

from .helpers import assert_clean


def _hooked(module, ids, submodule):
    seen = {}
    handle = submodule.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))
    try:
        with torch.no_grad():
            module(ids)
    finally:
        handle.remove()
    return seen["out"]


def test_path_parent_root(gpt2_model):
    mlp = gpt2_model.transformer.h[1].mlp
    assert gpt2_model.path == "model"
    assert mlp.path == "model.transformer.h.1.mlp"
    assert mlp.parent is gpt2_model.transformer.h[1]
    assert mlp.root is gpt2_model
    assert gpt2_model.parent is None and gpt2_model.root is gpt2_model


def test_modules_and_named_modules_return_envoys_in_nnsight_order(gpt2, gpt2_model):
    named = gpt2_model.named_modules()
    assert all(isinstance(e, Envoy) for _, e in named)
    # every module once, children before their parent; the paths are torch's (with "model.")
    torch_paths = {"model." + n if n else "model" for n, _ in gpt2.named_modules()}
    assert {p for p, _ in named} == torch_paths
    assert len(named) == len(torch_paths)
    position = {p: i for i, (p, _) in enumerate(named)}
    assert position["model.transformer.h.0.mlp.c_fc"] < position["model.transformer.h.0.mlp"]
    assert named[-1][0] == "model"
    for path, envoy in named:
        assert envoy.path == path
    mlps = gpt2_model.modules(include_fn=lambda e: type(e._module).__name__ == "GPT2MLP")
    assert [e.path for e in mlps] == ["model.transformer.h.0.mlp", "model.transformer.h.1.mlp"]
    assert gpt2_model.transformer.h[0].modules()[-1] is gpt2_model.transformer.h[0]


def test_get_walks_a_dotted_path_and_reads_values_in_a_trace(gpt2, gpt2_model, ids):
    assert gpt2_model.get("transformer.h.0.mlp") is gpt2_model.transformer.h[0].mlp
    with torch.no_grad(), gpt2_model.trace(ids):
        out = gpt2_model.get("transformer.h.0.mlp.output").save()
    assert torch.equal(out, _hooked(gpt2, ids, gpt2.transformer.h[0].mlp))
    with pytest.raises(AttributeError, match="no submodule or attribute 'nope'"):
        gpt2_model.get("transformer.nope")


def test_iteration_len_and_truthiness(gpt2_model):
    layers = gpt2_model.transformer.h
    assert len(layers) == 2
    assert [layer.path for layer in layers] == ["model.transformer.h.0", "model.transformer.h.1"]
    leaf = gpt2_model.transformer.h[0].mlp.c_fc
    assert len(leaf) == 0 and bool(leaf)


def test_device_devices_and_to_return_the_envoy(mlp, mlp_model):
    assert mlp_model.device == next(mlp.parameters()).device
    assert mlp_model.devices == {torch.device("cpu")}
    assert mlp_model[1].device is None  # ReLU has no parameters
    assert mlp_model.to("cpu") is mlp_model
    assert mlp_model.cpu() is mlp_model
    assert mlp_model[0].to(torch.float32) is mlp_model[0]


def test_a_module_reachable_at_two_paths_has_one_envoy():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
            self.first = self.body[0]  # the same Linear under a second name

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    model = interlace.Model(Holder())
    # whichever path is walked first, the Envoy is the one at torch's first path
    assert model.first is model.body[0]
    assert model.first.path == "model.body.0"
    x = torch.randn(2, 3)
    with torch.no_grad(), model.trace(x):
        a = model.first.output.save()
        b = model.body[0].output.save()
        model.body.output.save()
    assert a is b
    assert len([p for p, _ in model.named_modules()]) == 4


def test_output_outside_a_trace_is_a_value_error(gpt2_model):
    with pytest.raises(ValueError, match="only available inside a `with model.trace"):
        gpt2_model.transformer.h[0].output
    with pytest.raises(NotInTraceError):
        gpt2_model.transformer.h[0].inputs


def test_envoy_of_a_module_is_a_traceable_root(gpt2, ids):
    root = Envoy(gpt2)
    assert isinstance(root, Envoy) and isinstance(root, interlace.Model)
    assert type(root.transformer) is Envoy
    with torch.no_grad(), root.trace(ids):
        out = root.transformer.h[1].output.save()
    assert torch.equal(out, _hooked(gpt2, ids, gpt2.transformer.h[1]))
    assert_clean(gpt2)


def test_model_iter_and_all_are_deprecated_aliases(gpt2_model, ids):
    with torch.no_grad(), gpt2_model.trace(ids):
        with pytest.warns(DeprecationWarning, match="tracer.iter"):
            loop = gpt2_model.iter[0]
        for _ in loop:
            h = gpt2_model.transformer.h[0].output.save()
    assert h.shape[0] == ids.shape[0]


def test_a_submodule_named_like_an_envoy_value_is_reachable_as_E_name():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(4, 4)
            self.output = torch.nn.Linear(4, 4)  # BERT's layer has one

        def forward(self, x):
            return self.output(self.dense(x))

    torch.manual_seed(0)
    net = torch.nn.Sequential(Layer())
    with pytest.warns(UserWarning, match=r"model\.0\.output.*\.E_output"):
        model = interlace.Model(net)
    x = torch.randn(2, 4)
    with torch.no_grad(), model.trace(x):
        inner = model[0].E_output.output.save()   # the submodule's output
        whole = model[0].output.save()            # the layer's own output
    with torch.no_grad():
        want = net[0].output(net[0].dense(x))
    assert torch.equal(inner, want) and torch.equal(whole, want)
    assert model[0].E_output.path == "model.0.output"
    assert model[0]["output"] is model[0].E_output


class TestAliases:
    RENAME = {"transformer.h": "layers", ".*attn": "attention", "mlp": ["ff", "feedforward"]}

    def test_aliases_bind_to_the_same_envoy_and_activation(self, gpt2, ids):
        model = interlace.Model(gpt2, rename=self.RENAME)
        assert model.layers is model.transformer.h
        assert model.layers[0].attention is model.transformer.h[0].attn
        assert model.layers[1].ff is model.layers[1].feedforward is model.transformer.h[1].mlp
        with torch.no_grad(), model.trace(ids):
            via_alias = model.layers[1].ff.output.save()
        assert torch.equal(via_alias, _hooked(gpt2, ids, gpt2.transformer.h[1].mlp))

    def test_one_rename_serves_two_architectures(self, gpt2, llama, ids):
        rename = {"transformer.h": "layers", "model.layers": "layers", "attn": "attention",
                  "self_attn": "attention"}
        for module, attn in ((gpt2, gpt2.transformer.h[0].attn), (llama, llama.model.layers[0].self_attn)):
            model = interlace.Model(module, rename=rename)
            with torch.no_grad(), model.trace(ids):
                out = model.layers[0].attention.output[0].save()
            assert torch.equal(out, _hooked(module, ids, attn)[0])

    def test_a_class_key(self, gpt2):
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        model = interlace.Model(gpt2, rename={GPT2MLP: "ffn"})
        assert model.transformer.h[0].ffn is model.transformer.h[0].mlp

    def test_print_shows_aliases(self, gpt2):
        text = repr(interlace.Model(gpt2, rename=self.RENAME))
        assert "(attention/attn): GPT2Attention(" in text
        assert "(ff/feedforward/mlp): GPT2MLP(" in text
        assert "(layers): -> model.transformer.h" in text

    def test_an_alias_that_would_hide_something_is_refused(self, gpt2):
        with pytest.raises(ValueError, match="rename alias 'wte' for 'wpe' would hide a submodule"):
            interlace.Model(gpt2, rename={"wpe": "wte"})
        with pytest.raises(ValueError, match="would hide the envoy's own `.output`"):
            interlace.Model(gpt2, rename={"mlp": "output"})
        with pytest.raises(ValueError, match="would hide an attribute of the module"):
            interlace.Model(gpt2, rename={"transformer": "config"})

    def test_a_bad_rename_is_a_type_error(self, gpt2):
        with pytest.raises(TypeError, match="rename= takes a dict"):
            interlace.Model(gpt2, rename=["mlp"])


def test_the_tree_is_freed_by_reference_counting(ids):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    gc.collect()
    gc.disable()
    try:
        module = GPT2LMHeadModel(config).eval()
        ref = weakref.ref(module)
        model = interlace.Model(module, rename={"transformer.h": "layers"})
        layer = model.layers[0]
        assert layer.root is model
        model.named_modules()
        with torch.no_grad(), model.trace(ids):
            h = model.layers[1].mlp.output.save()
        del module, model, layer, h
        assert ref() is None
    finally:
        gc.enable()


class Heads(Envoy):
    @interlace.eproperty(key="output")
    def heads(self, value):
        b, s, h = value.shape
        return value.view(b, s, 4, h // 4)

    @heads.postprocess
    def heads(self, value):
        return value.flatten(-2)


def test_eproperty_reads_and_writes_through_an_envoy_subclass(gpt2, ids):
    model = interlace.Model(gpt2, envoys={"mlp": Heads})
    assert isinstance(model.transformer.h[0].mlp, Heads)
    assert type(model.transformer.h[0].attn) is Envoy
    with torch.no_grad(), model.trace(ids):
        per_head = model.transformer.h[0].mlp.heads.save()
        edited = model.transformer.h[1].mlp.heads
        model.transformer.h[1].mlp.heads = edited * 0
        logits = model.lm_head.output.save()
    want = _hooked(gpt2, ids, gpt2.transformer.h[0].mlp)
    assert torch.equal(per_head, want.view(*want.shape[:2], 4, -1))

    def zero(module, args, out):
        return out * 0

    handle = gpt2.transformer.h[1].mlp.register_forward_hook(zero)
    try:
        with torch.no_grad():
            reference = gpt2(ids).logits
            assert torch.equal(logits, reference)
    finally:
        handle.remove()
    with torch.no_grad():
        assert not torch.equal(logits, gpt2(ids).logits)


def test_envoys_by_module_class(gpt2):
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    model = interlace.Model(gpt2, envoys={GPT2MLP: Heads})
    assert isinstance(model.transformer.h[1].mlp, Heads)
    with pytest.raises(TypeError, match="envoys= takes an Envoy subclass"):
        interlace.Model(gpt2, envoys=[Heads])


def test_traceable_method_runs_the_model_through_it(mlp):
    class Twice(interlace.Model):
        @interlace.traceable
        def twice(self, x):
            return self._module(self._module(x[:, :6]).repeat(1, 2)[:, :6])

    model = Twice(mlp)
    x = torch.randn(2, 6)
    with torch.no_grad():
        direct = model.twice(x)            # not a with block: just a call
        want_first = mlp(x)
        assert torch.equal(direct, mlp(want_first.repeat(1, 2)[:, :6]))
    with torch.no_grad(), model.twice(x):
        first = model[4].output.save()     # occurrence 0: the first pass through the model
        out = model.output.save()
    assert torch.equal(first, want_first)
    assert torch.equal(out, want_first)
    assert_clean(mlp)


def test_remote_false_is_accepted_and_anything_else_is_a_clear_error(mlp_model, x6):
    with torch.no_grad(), mlp_model.trace(x6, remote=False):
        out = mlp_model.output.save()
    assert out.shape == (3, 4)
    with pytest.raises(interlace.InterlaceError, match=r"remote execution .* not supported"):
        mlp_model.trace(x6, remote=True)
