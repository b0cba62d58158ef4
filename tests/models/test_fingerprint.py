"""`fingerprint(module)`: any change to what the forward computes changes it, undoing the change
restores it, and running the model (a trace, a sweep) leaves it alone. Ray replicas are
re-shipped when it changes (tests/sweeps/test_ray_replicas.py checks the results); here,
without Ray, every kind of change, and a loaded LanguageModel's recipe.
"""

import pytest
import torch

from interlace.models.fingerprint import fingerprint


@pytest.fixture
def gpt2(model_dirs):
    """A fresh GPT-2 of each test's own: the tests change it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs["gpt2"]).eval()


def _hook(module, args, output):
    return output


def _identity(x):
    return x


def _swap(owner, name, value):
    """(change, undo) setting `owner.name = value` and back."""
    old = getattr(owner, name)
    return lambda: setattr(owner, name, value), lambda: setattr(owner, name, old)


def _handle(register):
    """(change, undo) registering a hook and removing it."""
    handles = []
    return lambda: handles.append(register()), lambda: handles.pop().remove()


CHANGES = {
    "train()": lambda m: (m.train, m.eval),
    "one submodule's training flag": lambda m: (m.transformer.h[1].attn.attn_dropout.train,
                                                m.transformer.h[1].attn.attn_dropout.eval),
    "forward hook": lambda m: _handle(lambda: m.transformer.h[0].register_forward_hook(_hook)),
    "forward hook with kwargs": lambda m: _handle(lambda: m.transformer.h[0].register_forward_hook(
        lambda mod, a, k, o: o, with_kwargs=True)),
    "pre-hook": lambda m: _handle(lambda: m.lm_head.register_forward_pre_hook(lambda mod, a: a)),
    "parameter-free submodule replaced": lambda m: _swap(m.transformer.h[1].mlp, "act",
                                                         torch.nn.ReLU()),
    "submodule added": lambda m: _handle(lambda: _Added(m.transformer.h[0], "extra")),
    "plain attribute": lambda m: _swap(m.transformer.h[1].attn, "scaling", 0.5),
    "config attribute": lambda m: _swap(m.config, "use_cache", not m.config.use_cache),
    "instance forward": lambda m: (lambda: setattr(m.transformer.h[1].mlp, "forward", _identity),
                                   lambda: delattr(m.transformer.h[1].mlp, "forward")),
    "parameter replaced": lambda m: _swap(m.lm_head, "weight",
                                          torch.nn.Parameter(m.lm_head.weight.detach() * 2)),
    "parameter .data replaced": lambda m: _swap(m.lm_head.weight, "data",
                                                m.lm_head.weight.detach() * 2),
    "buffer added": lambda m: _handle(lambda: _Added(m.transformer.h[0], "scale", torch.ones(1))),
}


class _Added:
    """Adds a submodule or a buffer under `name`; `.remove()` takes it away (a handle)."""

    def __init__(self, owner, name, buffer=None):
        self.owner, self.name = owner, name
        if buffer is None:
            owner.add_module(name, torch.nn.Identity())
        else:
            owner.register_buffer(name, buffer)

    def remove(self):
        delattr(self.owner, self.name)


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_a_change_changes_the_fingerprint_and_undoing_it_restores_it(gpt2, kind):
    change, undo = CHANGES[kind](gpt2)
    before = fingerprint(gpt2)
    change()
    changed = fingerprint(gpt2)
    undo()
    assert changed != before
    assert fingerprint(gpt2) == before


def test_an_in_place_edit_changes_the_fingerprint_even_when_undone(gpt2):
    """Tensor data is never read (that would cost a pass over the weights): the version
    counter says an in-place edit happened, so edited and edited back re-ships too."""
    before = fingerprint(gpt2)
    with torch.no_grad():
        gpt2.lm_head.weight.mul_(2)
    edited = fingerprint(gpt2)
    with torch.no_grad():
        gpt2.lm_head.weight.div_(2)
    assert before != edited != fingerprint(gpt2) != before


@pytest.mark.parametrize("how", ["replaced", "in place"])
def test_a_buffer_changes_the_fingerprint(model_dirs, how):
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    rotary = llama.model.rotary_emb
    before = fingerprint(llama)
    if how == "replaced":
        rotary.inv_freq = rotary.inv_freq * 2
    else:
        rotary.inv_freq.mul_(2)
    assert fingerprint(llama) != before


def test_running_the_model_leaves_the_fingerprint_alone(gpt2, model_dirs):
    import interlace

    model = interlace.Model(gpt2)
    before = fingerprint(gpt2)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), model.trace(ids):
        model.transformer.h[0].mlp.output[:] = 0
        out = model.lm_head.output.save()
    with torch.no_grad(), model.sweep(range(3), input=ids, progress=False) as sweep:
        model.transformer.h[1].output[:, sweep.item] = 0
        logits = model.lm_head.output.save()
    assert len(logits) == 3 and out.shape == logits[0].shape
    assert fingerprint(gpt2) == before


def test_a_loaded_language_model_changed_since_loading_ships_instead_of_reloading(model_dirs):
    """A Ray worker rebuilds a model loaded by name from that name only while the driver's
    still computes what it loaded: after `h[1].mlp.act = ReLU()` it must get the module."""
    import interlace

    lm = interlace.LanguageModel(str(model_dirs["gpt2"]))
    with torch.no_grad(), lm.trace("hello world"):
        lm.lm_head.output.save()
    assert lm.wrapper_recipe()[3], "unchanged after loading (and a trace): rebuilt from its folder"
    mlp = lm._module.transformer.h[1].mlp
    act = mlp.act
    mlp.act = torch.nn.ReLU()
    cls, args, kwargs, loaded = lm.wrapper_recipe()
    assert not loaded and isinstance(args[0], torch.nn.Module), "changed: the module travels"
    mlp.act = act
    assert lm.wrapper_recipe()[3]
