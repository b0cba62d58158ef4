"""What a run installs on the model: taps and hooks on the locations bodies ask for, and
forward overrides for `skip`. All of it belongs to the run and is removed at its teardown
(`remove`).

Only locations some body asked for are hooked, at the moment it asks (the model has not
reached them yet, or the request is out of order anyway); a module nobody asked about runs
exactly as it does outside a trace. A module with no torch hooks of its own (and no global
ones) gets a `Tap`: the run's compiled forward wrapper, set on the instance, which fires its
input and output events around the original forward. torch then calls the module on its fast
path; a torch hook would send every call of it down the slow path, which costs about what a
small module's own work costs. A module that already has hooks gets torch hooks instead, so
that ours run after the user's, as they always have. Either way each event goes through the
run's compiled event exchange (`exchange.py`); a location with pending skips or observers is
routed to `routed` here.
"""

from __future__ import annotations


import inspect
import sys
import warnings
import weakref

import torch
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from .._native import hotpath
from ..errors import ForwardReplacedWarning
from .batching import swap

_MISSING = hotpath.UNSET  # a `tapped` entry's "no instance forward before" (shared with Taps)

# Hooks go straight into the module's hook dicts, exactly as `register_forward_(pre_)hook`
# puts them there, minus the `RemovableHandle` and its weakrefs (a third of a trace's hook
# cost). Ids come from torch's own counter so they never collide with anybody's handle.
DIRECT_HOOKS = all(
    hasattr(torch.nn.Module(), name)
    for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks")
)


def attach(module, hook, pre):
    """Install `hook` on `module` (a with-kwargs pre-hook, or a forward hook); returns a token."""
    if not DIRECT_HOOKS:
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
    # the common case, compiled: every module on the way plain (hotpath.Taps)
    if not run.tapper.install(run, key, run.root_call):
        install_by_policy(run, key)


def install_by_policy(run, key):
    """`install` where the compiled tapper's common case does not apply (a module with hooks
    of its own, global hooks, a replaced forward, a class not checked yet)."""
    handles = run.handles
    state = run.state
    if key in handles or key >= state.result_key or (key < 2 and run.root_call):
        return  # the result, a root fired by hand, or an added location (no module hook)
    index = key >> 1
    # A call of a module fetches its forward (a Tap) as it starts, and torch reads a
    # module's forward hooks after its forward only on the slow path, which a call takes
    # when the module had a hook as it started. Tapping (or hooking) the containers of a
    # requested location before they start keeps a later request for a container's
    # output (asked while the model is inside it) servable. `ancestors` lists them from
    # the root down, so each one is installed after its own containers, as a request for
    # it would install them.
    for ancestor in state.ancestors[index]:
        pre = 2 * ancestor
        if pre not in handles and not (pre < 2 and run.root_call):
            _hook(run, pre, ancestor)
    _hook(run, key, index)


def _hook(run, key, index):
    """Fire `key`'s events for `run`: from module `index`'s Tap (installed here, once per run),
    or from a torch hook when the module cannot have one (`_tappable`)."""
    if index not in run.taps:
        state = run.state
        module = state.modules[index]
        module_dict = module.__dict__
        current = module_dict.get("forward")  # an instance forward, or None (the class's)
        if current is not state.forwards[index]:
            check_forward(run, index, module)
        if not _tappable(module_dict, type(module)):
            run.hub.observe(key)
            if key & 1:
                run.handles[key] = attach(module, run.post_hook(key), False)
            else:
                run.handles[key] = attach(module, run.pre_hook(key), True)
            return
        if current is state.forwards[index]:
            run.tapper.know(index, type(module))  # next time `Taps.install` taps it alone
    # The Tap (made once per run) wraps whatever forward the module has now (an accelerate or
    # user wrapper); nothing to detach per key: the tap goes as a whole (`remove`).
    run.tapper.tap(run, key, index)


# Set on the forwards a run installs itself (a skip's override, `.source`'s rewritten copy).
OURS = "__interlace_forward__"


def mark(forward):
    """Mark `forward` as one a run installs (not a user's replacement: `check_forward`)."""
    setattr(forward, OURS, True)
    return forward


def check_forward(run, index, module):
    """Module `index`'s instance `forward` is not the one it had when the model was wrapped:
    warn once per module (nnsight warns too), unless the run or a library that keeps the
    slot put it there: a Tap (another run's, a nested trace's), a forward a run installs,
    accelerate's alignment wrapper (`_hf_hook`), nnsight's controller."""
    state = run.state
    forward = module.__dict__.get("forward")
    if (index in state.forward_warned or type(forward) is hotpath.Tap
            or getattr(forward, OURS, False) or "_hf_hook" in module.__dict__
            or "__nnsight__" in module.__dict__):
        return
    state.forward_warned.add(index)
    path = state.paths[index]
    what = getattr(forward, "__qualname__", None) or type(forward).__name__
    filename, lineno = _user_frame()
    warnings.warn_explicit(ForwardReplacedWarning(
        f"{path}: `forward` was replaced after the model was wrapped (now {what}). Traces run "
        f"the new forward, with this module's values around it, but the module order learned "
        f"on the model's first trace came from the old one: if the new forward calls other "
        f"modules, or in another order, requests can be refused as out of order. Wrap the "
        f"model after replacing `forward` (or put the original back)"
    ), ForwardReplacedWarning, filename, lineno)


def _user_frame():
    """(filename, lineno) of the innermost frame outside interlace (the body's line)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "<interlace>", 0
    return frame.f_code.co_filename, frame.f_lineno


_PACKAGE_DIR = __file__.rsplit("intervention", 1)[0]


# torch's global module hooks (registered by `register_module_forward_hook` and the like):
# the dicts themselves, which torch mutates in place, read without a module lookup per trace.
GLOBAL_HOOKS = tuple(
    getattr(_torch_module, name, {})  # (a torch without one: an empty dict stands in)
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks")
)
_OWN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _tappable(module_dict, cls):
    """Can a module's events come from a Tap? Not when torch would call it on its slow path
    anyway (hooks of its own, or global ones): our hooks then run after those, as before;
    nor when its class would not find an instance `forward` (`_forward_by_instance`).
    Reads the module's instance dict (`module_dict`) directly: an attribute read of an
    `nn.Module` goes through its `__getattr__` hook, several times the cost."""
    if not DIRECT_HOOKS:
        return False
    forward, forward_pre, backward, backward_pre = GLOBAL_HOOKS
    if forward or forward_pre or backward or backward_pre:
        return False
    for name in _OWN_HOOKS:
        if module_dict.get(name):
            return False
    entry = _BY_CLASS.get(id(cls))
    if entry is None or entry[0]() is not cls:
        entry = _remember_class(cls)
    return entry[1]


# id(class) -> (weak reference to it, `_forward_by_instance(class)`): a plain dict read per
# install (a WeakKeyDictionary lookup is a Python call); an entry goes with its class.
_BY_CLASS = {}


def _remember_class(cls):
    key = id(cls)

    def forget(ref):
        if _BY_CLASS.get(key, (None,))[0] is ref:
            del _BY_CLASS[key]

    entry = _BY_CLASS[key] = (weakref.ref(cls, forget), _forward_by_instance(cls))
    return entry


def _forward_by_instance(cls):
    """Does a call of a `cls` module run `self.forward` as set on the instance? Not for a
    scripted module (its forward is compiled) or a class whose `forward` is a data descriptor
    (a property: the instance's dict is never read). Remembered per class (`_BY_CLASS`)."""
    forward = inspect.getattr_static(cls, "forward", None)
    return not (issubclass(cls, torch.jit.ScriptModule) or hasattr(type(forward), "__set__"))


def forward_of(module):
    """What runs as `module`'s forward, looking through this run's Tap (`source.py` rewrites it)."""
    forward = module.__dict__.get("forward")
    return forward.original if type(forward) is hotpath.Tap else forward


def set_forward(module, forward):
    """Make `forward` what runs as `module`'s instance forward, inside its Tap if it has one
    (torch may already hold the Tap for a call in progress: it reads `original` at the call)."""
    tap = module.__dict__.get("forward")
    if type(tap) is hotpath.Tap:
        tap.original = forward
    else:
        module.__dict__["forward"] = forward


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
    tap = run.taps.get(index)
    original = module.forward if tap is None else tap.original
    skips = run.skips

    @mark
    def forward(*args, **kwargs):
        pending = skips.get(index) if not run.bypass else None
        if pending is not None and len(pending) == 1 and pending[0][0] is None:
            return pending[0][1]
        return original(*args, **kwargs)

    # Inside the module's tap, if it has one, so that the skipped module's events still
    # fire; that override goes with the tap (`remove`), the other one is undone there.
    run.overrides[index] = (None, None) if tap is not None else (
        module, module.__dict__.get("forward", _MISSING))
    set_forward(module, forward)


def remove(run):
    """Remove every tap, hook and forward override `run` installed. The taps go in one
    compiled call, which hands back the torch hooks' tokens to detach here."""
    if run.handles:
        tokens = run.tapper.remove()
        if tokens:
            for token in tokens:
                detach(token)
    if run.overrides:
        for module, previous in run.overrides.values():
            if module is None:
                continue  # it was inside a tap
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        run.overrides.clear()
