"""Plain-torch references the engine's tests compare against, and cleanliness checks."""

import contextlib

import torch


def logits(out):
    return out.logits if hasattr(out, "logits") else out


@contextlib.contextmanager
def hooked(module, *, output=None, pre=None):
    """Plain torch hooks as the independent reference: `output`/`pre` map submodule -> fn."""
    handles = []
    try:
        for sub, fn in (output or {}).items():
            handles.append(sub.register_forward_hook(fn))
        for sub, fn in (pre or {}).items():
            handles.append(sub.register_forward_pre_hook(fn, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def reference_outputs(module, inputs, subs, kwargs=None):
    """The outputs of `subs` (cloned) in a plain run, and the run's result."""
    seen = {}

    def grab(name):
        def hook(mod, args, out):
            seen[name] = out.clone() if isinstance(out, torch.Tensor) else out

        return hook

    with torch.no_grad(), hooked(module, output={sub: grab(i) for i, sub in enumerate(subs)}):
        result = module(*inputs, **(kwargs or {}))
    return [seen[i] for i in range(len(subs))], result


def assert_clean(module):
    """No hooks, no forward overrides, no active trace left on `module` or any submodule."""
    for name, sub in module.named_modules():
        assert not sub._forward_hooks, f"forward hook left on {name!r}"
        assert not sub._forward_pre_hooks, f"pre-hook left on {name!r}"
        assert not sub._backward_hooks, f"backward hook left on {name!r}"
        assert "forward" not in sub.__dict__, f"forward override left on {name!r}"
