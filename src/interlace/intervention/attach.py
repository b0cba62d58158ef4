"""Attachments: a module added to the model after wrapping, applied by a body, watched.

nnsight 0.8.1's form for an adapter, a LoRA or an SAE applied in an edit:

    model.transformer.h[0].adapter = Adapter()
    with model.edit() as edited:
        h = edited.transformer.h[0].output
        edited.transformer.h[0].output = edited.transformer.h[0].adapter(h, hook=True)
    with edited.trace(x):
        inner = edited.transformer.h[0].adapter.inner.output.save()

The attached module is not part of the model's forward: it runs where a body calls it. A
plain call from a body (`envoy(x)`) runs it unwatched (`Interleaver.call_plain`);
`envoy(x, hook=True)` runs it *watched*: the body hands the call to the model side
(`WatchedCall`, a message like PARKED), which runs the module there, the way the model runs
its own modules, so that the input and output of the attached module and of every module
under it are locations other bodies can read and edit; then the calling body goes on with
the module's output (or its error, raised at the body's line).

Such locations are counted per invoke: one invoke's (or sweep item's) call serves only the
bodies of that invoke, which see the value whole (it holds that invoke's rows only). Their
keys are added locations (`Interleaver.add_locations`), one pair per attached module and
invoke rows, stable for the model's life. A module the model was wrapped with is not an
attachment: `hook=True` on it runs it unwatched, as a plain call does.
"""

from __future__ import annotations

import torch

from ..errors import NotInTraceError


class WatchedCall:
    """A body's request to run an attached module watched (see the module docstring)."""

    __slots__ = ("module", "path", "args", "kwargs")

    def __init__(self, module, path, args, kwargs):
        self.module = module
        self.path = path
        self.args = args
        self.kwargs = kwargs


def call(interleaver, module, path, args, kwargs):
    """Body side: run `module` watched on the model side; its output (or its error, raised)."""
    mediator = interleaver.mediator(f"{path}(..., hook=True)")
    return mediator.wait(WatchedCall(module, path, args, kwargs))


def serve(interleaver, mediator, message, event):
    """Model side: run the watched calls `mediator` asks for, resuming it with each output,
    until it comes back with another message (which is returned)."""
    while type(message) is WatchedCall:
        payload = _run(interleaver, mediator, message)
        try:
            message = interleaver.resume(mediator, event, payload)
        finally:
            payload = None  # an error's traceback holds this frame: no cycle through a local
    return message


def key(interleaver, module, path, rows):
    """The input key of attached `module` (its output's is the next) for bodies seeing `rows`."""
    owner = ("attached", module) if rows is None else ("attached", module, rows.start, rows.stop)
    return interleaver.add_locations(owner, (f"{path}.input", f"{path}.output"))


def is_attached(interleaver, module):
    """Was `module` added to the tree after the model was wrapped?"""
    return id(module) not in interleaver.state.index


def _run(interleaver, mediator, watched):
    """Call the module with its attached modules' events fired; the output, or the error."""
    state = interleaver.state
    rows = mediator.rows
    handles = []
    try:
        for name, module in watched.module.named_modules():
            if id(module) in state.index:
                continue  # one of the model's own modules: not watched here
            path = f"{watched.path}.{name}" if name else watched.path
            base = key(interleaver, module, path, rows)
            handles.append(module.register_forward_pre_hook(_pre(interleaver, base), with_kwargs=True))
            handles.append(module.register_forward_hook(_post(interleaver, base + 1)))
        grad = mediator.body_grad
        with torch.set_grad_enabled(torch.is_grad_enabled() if grad is None else grad):
            return watched.module(*watched.args, **watched.kwargs)
    except Exception as error:  # noqa: BLE001 - raised again at the body's line
        return error
    finally:
        for handle in handles:
            handle.remove()


def _pre(interleaver, key):
    def hook(module, args, kwargs):
        return interleaver.handoff(key, (args, kwargs))

    return hook


def _post(interleaver, key):
    def hook(module, args, output):
        return interleaver.handoff(key, output)

    return hook


def not_watched(path, what):
    """The error for `what` (`.output`, ...) of an attachment outside any run."""
    return NotInTraceError(
        f"{path}.{what}: {path} was added to the model after it was wrapped, so the model's "
        f"forward does not run it; its values exist only inside a trace, where a body "
        f"calls it as `{path}(x, hook=True)`"
    )
