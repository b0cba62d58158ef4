"""What a run installs on the model: hooks on the locations bodies ask for, and forward
overrides for `skip`. All of it belongs to the run and is removed at its teardown (`remove`).

Only locations some body asked for are hooked, at the moment it asks (the model has not
reached them yet, or the request is out of order anyway); a module nobody asked about runs
exactly as it does outside a trace. Each hook is the run's compiled event exchange
(`exchange.py`); a location with pending skips or observers is routed to `routed` here.
"""

from __future__ import annotations


import torch
from torch.utils.hooks import RemovableHandle

from .batching import swap

_MISSING = object()

# Hooks go straight into the module's hook dicts, exactly as `register_forward_(pre_)hook`
# puts them there, minus the `RemovableHandle` and its weakrefs (a third of a trace's hook
# cost). Ids come from torch's own counter so they never collide with anybody's handle.
_DIRECT_HOOKS = all(
    hasattr(torch.nn.Module(), name)
    for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks")
)


def attach(module, hook, pre):
    """Install `hook` on `module` (a with-kwargs pre-hook, or a forward hook); returns a token."""
    if not _DIRECT_HOOKS:
        if pre:
            return module.register_forward_pre_hook(hook, with_kwargs=True)
        return module.register_forward_hook(hook)
    hid = RemovableHandle.next_id
    RemovableHandle.next_id = hid + 1
    if pre:
        module._forward_pre_hooks[hid] = hook
        module._forward_pre_hooks_with_kwargs[hid] = True
        return (hid, module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs)
    module._forward_hooks[hid] = hook
    return (hid, module._forward_hooks)


def detach(token):
    """Remove what `attach` installed."""
    if type(token) is not tuple:
        token.remove()
        return
    hid = token[0]
    for hooks in token[1:]:
        hooks.pop(hid, None)


def install(run, key):
    """Hook location `key` for `run` (once): a pre-hook for an input, a forward hook for an output."""
    handles = run.handles
    state = run.state
    if key in handles or key >= state.result_key or (key < 2 and run.root_call):
        return  # the result, a root fired by hand, or an added location (no module hook)
    index = key >> 1
    # torch reads a module's forward hooks after its forward only on its slow path, which
    # a call takes when the module had a hook as it started. Hooking the containers of a
    # requested location before they start keeps a later request for a container's
    # output (asked while the model is inside it) servable. `ancestors` lists them from
    # the root down, so each one is hooked after its own containers, as a request for it
    # would hook them.
    for ancestor in state.ancestors[index]:
        pre = 2 * ancestor
        if pre not in handles and not (pre < 2 and run.root_call):
            _hook(run, pre, state.modules[ancestor])
    _hook(run, key, state.modules[index])


def _hook(run, key, module):
    run.hub.observe(key)
    if key & 1:
        run.handles[key] = attach(module, run.post_hook(key), False)
    else:
        run.handles[key] = attach(module, run.pre_hook(key), True)


def routed(run, key, occ, value):
    """The rest of an event at a routed key (pending skips, observers), after the count.

    The run's compiled hooks (`hotpath.Exchange`) do everything else: a key goes through
    here only while `run.route(key)` says it needs this policy. Returns what the hook
    returns: the replacement of the output (or of the input's `(args, kwargs)`), or None.
    """
    replaced = False
    if key & 1:
        skips = run.skips
        if skips:
            pending = skips.pop(key >> 1, None)
            if pending is not None:
                for rows, skipped in pending:
                    value = skipped if rows is None else swap(value, skipped, rows, run.total)
                replaced = True
    event = run.deliver(key, occ, value)
    if event is not None:
        value = event.value
        replaced = replaced or event.replaced
    if run.observers:
        run.notify(key, value)
    return value if replaced else None


def override_forward(run, index):
    """Let `skip` avoid running module `index`: its forward returns the pending value."""
    if index in run.overrides:
        return
    module = run.state.modules[index]
    previous = module.__dict__.get("forward", _MISSING)
    original = module.forward
    skips = run.skips

    def forward(*args, **kwargs):
        pending = skips.get(index) if not run.bypass else None
        if pending is not None and len(pending) == 1 and pending[0][0] is None:
            return pending[0][1]
        return original(*args, **kwargs)

    run.overrides[index] = (module, previous)
    module.forward = forward


def remove(run):
    """Remove every hook and forward override `run` installed."""
    for token in run.handles.values():
        detach(token)
    run.handles.clear()
    for module, previous in run.overrides.values():
        if previous is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
    run.overrides.clear()
