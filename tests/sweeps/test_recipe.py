"""How a Ray worker rebuilds a wrapper: checked without Ray."""


def test_a_worker_rebuilds_the_wrapper_with_its_aliases_and_envoy_classes(gpt2):
    """What a worker builds from the recipe has the driver's rename= and envoys= (no Ray needed)."""
    import interlace
    from interlace.sweeps.executors.ray import _recipe

    class Mine(interlace.Envoy):
        pass

    model = interlace.Model(gpt2, rename={"transformer.h": "layers"}, envoys={"mlp": Mine})
    cls, args, kwargs, _ = _recipe(model, on_gpu=False)
    copy = cls(*args, **kwargs)
    assert copy.layers[0].mlp.path == "model.transformer.h.0.mlp"
    assert isinstance(copy.layers[0].mlp, Mine)
