"""Kept Ray replicas never go stale: after any change to what the model's forward computes
(training flag, a hook added or removed, a submodule replaced, a parameter or buffer replaced
or edited in place, a plain attribute the forward reads), the next `executor="ray"` sweep
equals `executor="local"` and plain torch hooks on the changed model, item for item.

Each test first runs a Ray sweep (so the actors hold the model as it was), then changes the
model, then compares; the change is undone afterwards. One local Ray cluster for the session
(conftest.py), two workers; torch runs one thread, as each Ray actor does: bitwise equal.
"""

import pytest
import torch

from .conftest import VOCAB, _gpt2

pytestmark = pytest.mark.slow

POSITIONS = [0, 3, 5, 7]


@pytest.fixture(scope="module")
def gpt2_changing():
    """A GPT-2 of its own: these tests change it (and undo it)."""
    return _gpt2(VOCAB)


@pytest.fixture(scope="module")
def changing(gpt2_changing):
    import interlace

    return interlace.Model(gpt2_changing)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs (Ray gives an actor one CPU): bitwise equal
    yield
    torch.set_num_threads(threads)


def plain(module, ids, block):
    """The reference: plain torch forward hooks on the module, one forward per position."""
    out = []
    for pos in POSITIONS:
        def zero(m, a, o, pos=pos):
            hidden = (o[0] if isinstance(o, tuple) else o).clone()
            hidden[:, pos] = 0
            return (hidden, *o[1:]) if isinstance(o, tuple) else hidden

        handle = block.register_forward_hook(zero)
        try:
            with torch.no_grad():
                out.append(module(ids).logits[:, -1])
        finally:
            handle.remove()
    return out


def check_change(model, module, block, ids, change, undo=lambda: None):
    """Ray sweep, `change()`, then ray == local == plain hooks, and the change mattered."""
    before = sweep(model, ids, "ray")  # the actors now hold the model as it is
    change()
    try:
        remote, local = sweep(model, ids, "ray"), sweep(model, ids, "local")
        reference = plain(module, ids, block)
    finally:
        undo()
    for pos, r, lo, ref in zip(POSITIONS, remote, local, reference):
        assert torch.equal(lo, ref), f"local executor differs from plain hooks at {pos}"
        assert torch.equal(r, lo), f"the Ray replica ran the model from before the change ({pos})"
    assert not all(map(torch.equal, remote, before)), "the change moves no logit: a useless test"


def _sweep_gpt2(model, ids, executor):
    with torch.no_grad(), model.sweep(POSITIONS, input=ids, batch_size=1, workers=2,
                                      executor=executor, progress=False) as sweep:
        model.transformer.h[0].output[:, sweep.item] = 0
        logits = model.lm_head.output[:, -1].save()
    return logits


def _sweep_llama(model, ids, executor):
    with torch.no_grad(), model.sweep(POSITIONS, input=ids, batch_size=1, workers=2,
                                      executor=executor, progress=False) as sweep:
        model.model.layers[0].output[:, sweep.item] = 0
        logits = model.lm_head.output[:, -1].save()
    return logits


def sweep(model, ids, executor):
    """Zero position `item` of the first block's output; the last position's logits per item."""
    runner = _sweep_llama if hasattr(model, "model") else _sweep_gpt2
    return runner(model, ids, executor)


def gpt2_check(changing, gpt2_changing, ids, change, undo=lambda: None):
    check_change(changing, gpt2_changing, gpt2_changing.transformer.h[0], ids, change, undo)


def test_training_flag(ray_cluster, one_thread, changing, gpt2_changing, corrupt):
    """`.train()` turns dropout on: the same seeded masks on the driver and on the workers."""
    seed = gpt2_changing.register_forward_pre_hook(lambda m, a: torch.manual_seed(0) and None)
    try:
        gpt2_check(changing, gpt2_changing, corrupt, gpt2_changing.train, gpt2_changing.eval)
    finally:
        seed.remove()


def test_a_hook_added(ray_cluster, one_thread, changing, gpt2_changing, corrupt):
    handles = []
    mlp = gpt2_changing.transformer.h[1].mlp
    gpt2_check(changing, gpt2_changing, corrupt,
               lambda: handles.append(mlp.register_forward_hook(lambda m, a, o: o * 2)),
               lambda: handles.pop().remove())


def test_a_hook_removed(ray_cluster, one_thread, changing, gpt2_changing, corrupt):
    mlp = gpt2_changing.transformer.h[1].mlp
    handle = mlp.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    try:
        gpt2_check(changing, gpt2_changing, corrupt, handle.remove)
    finally:
        handle.remove()


def test_a_parameter_free_submodule_replaced(ray_cluster, one_thread, changing, gpt2_changing,
                                             corrupt):
    mlp = gpt2_changing.transformer.h[1].mlp
    act = mlp.act

    def change():
        mlp.act = torch.nn.ReLU()

    def undo():
        mlp.act = act

    gpt2_check(changing, gpt2_changing, corrupt, change, undo)


def test_a_plain_attribute_the_forward_reads(ray_cluster, one_thread, changing, gpt2_changing,
                                             corrupt):
    attn = gpt2_changing.transformer.h[1].attn
    scaling = attn.scaling
    gpt2_check(changing, gpt2_changing, corrupt, lambda: setattr(attn, "scaling", 0.5),
               lambda: setattr(attn, "scaling", scaling))


@pytest.mark.parametrize("how", ["replaced", "in place"])
def test_a_parameter(ray_cluster, one_thread, changing, gpt2_changing, corrupt, how):
    linear = gpt2_changing.transformer.h[1].mlp.c_fc
    weight = linear.weight

    def change():
        with torch.no_grad():
            if how == "replaced":
                linear.weight = torch.nn.Parameter(weight * 2)
            else:
                weight.mul_(2)

    def undo():
        with torch.no_grad():
            if how == "replaced":
                linear.weight = weight
            else:
                weight.div_(2)

    gpt2_check(changing, gpt2_changing, corrupt, change, undo)


def test_nothing_changed_keeps_the_replicas(ray_cluster, one_thread, changing, gpt2_changing,
                                            corrupt):
    """Unchanged model, a trace in between: the next sweep neither makes actors nor re-ships."""
    import ray

    from interlace.sweeps.executors.ray import _actors

    first = sweep(changing, corrupt, "ray")
    with torch.no_grad(), changing.trace(corrupt):
        changing.transformer.h[1].mlp.output[:] = 0
    actors, recipe = _actors(ray, changing, 2)
    assert recipe is None
    second = sweep(changing, corrupt, "ray")
    again, recipe = _actors(ray, changing, 2)
    assert again == actors and recipe is None
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_model(llama):
    import interlace

    return interlace.Model(llama)


@pytest.mark.parametrize("how", ["replaced", "in place"])
def test_a_buffer(ray_cluster, one_thread, llama, llama_model, corrupt, how):
    """Llama's rotary frequencies are a (non-persistent) buffer the forward reads."""
    rotary = llama.model.rotary_emb
    inv_freq = rotary.inv_freq

    def change():
        if how == "replaced":
            rotary.inv_freq = inv_freq * 3
        else:
            inv_freq.mul_(4)

    def undo():
        if how == "replaced":
            rotary.inv_freq = inv_freq
        else:
            inv_freq.div_(4)

    check_change(llama_model, llama, llama.model.layers[0], corrupt, change, undo)
