"""Gradients inside a trace, as nnsight does them: `with loss.backward():` then `h.grad`.

While a trace runs, `Tensor.backward` called as the item of a `with` statement (and only
then: a plain `loss.backward()` is torch's own) returns a `BackwardTracer`. Its body is
captured like any block and runs as a mediator while torch runs the backward pass: reading
`h.grad` registers a tensor hook on `h` and waits for the gradient flowing through it;
assigning `h.grad = g` replaces what flows further back. Gradients arrive from the loss back
toward the inputs, so a request for a tensor backward has already passed (or that no gradient
reaches) raises `OutOfOrderError` when the backward pass ends.

The two patches (`Tensor.backward`, and `Tensor.grad` while a backward body runs) are owned
by the runs that install them, reference-counted across threads, and removed in `finally`.
"""

from __future__ import annotations

import dis
import sys
import threading
import weakref

import torch
from greenlet import getcurrent

from .._native import hotpath
from ..errors import InterlaceError, OutOfOrderError
from ..tracing import Backend, Tracer
from ..versions import WITH_ENTER_OPS
from .batching import origin
from .body import BodyJob
from .mediator import DONE, FAILED, PARKED, STOPPED, Mediator, _is_grad_enabled, _set_grad_enabled

_original_backward = torch.Tensor.backward
_base_grad = torch._C.TensorBase.__dict__["grad"]
_lock = threading.Lock()
_installed = {"backward": 0, "grad": 0}
_local = threading.local()  # .runs: the GradRuns of this thread, innermost last
_with_after_call: dict = {}


def followed_by_with(frame) -> bool:
    """Is the call at `frame.f_lasti` the item of a `with` statement?"""
    code = frame.f_code
    key = (code, frame.f_lasti)
    answer = _with_after_call.get(key)
    if answer is None:
        # f_lasti is the CALL, or (3.11+) the last of its inline cache entries: the next
        # real instruction is what the call's result feeds.
        answer = False
        for instruction in dis.get_instructions(code):
            if instruction.offset > frame.f_lasti:
                answer = instruction.opname in WITH_ENTER_OPS
                break
        if len(_with_after_call) > 4096:
            _with_after_call.clear()
        _with_after_call[key] = answer
    return answer


# id(Block) -> (weak reference to it, does its body use `with ....backward():`): a plain dict
# read per trace (a WeakKeyDictionary's is a Python call); the entry goes with the Block (a
# Block holds the caller's globals through its compiled body functions).
_uses_backward = {}


def block_uses_backward(block) -> bool:
    """Does the captured body contain `with <expr>.backward(...):`? (cached per block)

    The `Tensor.backward` patch is installed only for such bodies: setting an attribute on
    `torch.Tensor` invalidates the type's method caches, which every later tensor method
    lookup pays for, so a trace that does not need it must not install it. The `with` has to
    be in the body itself (a helper function's `with loss.backward():` is not seen).
    """
    if block is None:
        return False
    entry = _uses_backward.get(id(block))
    if entry is not None and entry[0]() is block:
        return entry[1]
    import ast

    found = False
    for statement in getattr(block, "statements", None) or ():
        for node in ast.walk(statement):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    call = item.context_expr
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr == "backward"):
                        found = True
    key = id(block)

    def forget(ref):
        if _uses_backward.get(key, (None,))[0] is ref:
            del _uses_backward[key]

    _uses_backward[key] = (weakref.ref(block, forget), found)
    return found


def _backward(self, *args, **kwargs):
    if followed_by_with(sys._getframe(1)):
        return BackwardTracer(self, args, kwargs)
    return _original_backward(self, *args, **kwargs)


class _Grad:
    """`Tensor.grad` while a backward body runs: the gradient flowing through the tensor."""

    def __get__(self, tensor, owner=None):
        if tensor is None:
            return self
        run = _current_run()
        if run is None:
            return _base_grad.__get__(tensor, owner)
        return run.read(tensor)

    def __set__(self, tensor, value):
        run = _current_run()
        if run is None:
            _base_grad.__set__(tensor, value)
        else:
            run.write(tensor, value)

    def __delete__(self, tensor):
        _base_grad.__delete__(tensor)


def _current_run():
    runs = getattr(_local, "runs", None)
    if runs:
        run = runs[-1]
        mediator = run.mediator
        if mediator is not None and mediator.worker is getcurrent():
            return run
    return None


def install(name):
    """Install a patch (`"backward"` or `"grad"`) for the caller's run; undo with `uninstall`."""
    with _lock:
        _installed[name] += 1
        if _installed[name] == 1:
            if name == "backward":
                torch.Tensor.backward = _backward
            else:
                torch.Tensor.grad = _Grad()


def uninstall(name):
    with _lock:
        _installed[name] -= 1
        if _installed[name] == 0:
            if name == "backward":
                torch.Tensor.backward = _original_backward
            else:
                del torch.Tensor.grad


class BackwardTracer(Tracer):
    """`with loss.backward(...):` inside a trace body: the body reads and edits `.grad`."""

    def __init__(self, tensor, args, kwargs):
        super().__init__(backend=_BackwardBackend())
        self.tensor = tensor
        self.backward_args = args
        self.backward_kwargs = kwargs


class GradRun:
    """One backward pass with one mediator: tensor hooks hand gradients over.

    Each tensor the body asks about is a location of this run (its key, in request order);
    its hook hands the gradient over through the same event exchange as module hooks
    (`exchange.py`). A request for one invoke's rows reads and edits only those rows of the
    batch tensor's gradient, which is what backward reaches.
    """

    def __init__(self):
        self.mediator = None
        self.hub = hotpath.Hub(0, -1, None, None, False)  # keys grow as tensors are asked for
        self.exchange = hotpath.Exchange(_is_grad_enabled, _set_grad_enabled, message=self._message)
        self.exchange.begin(self.hub, threading.get_ident())
        self.keys = {}  # id(hooked tensor) -> its key
        self.shapes = []  # key -> shape of the tensor last requested there (for messages)
        self.handles = []
        self.done = False

    def run(self, body, tensor, args, kwargs):
        mediator = self.mediator = Mediator(body, label="backward body")
        runs = _local.__dict__.setdefault("runs", [])
        runs.append(self)
        install("grad")
        try:
            message = mediator.start()
            if message == FAILED:
                raise mediator.error
            if message != DONE:
                try:
                    _original_backward(tensor, *args, **kwargs)
                except _BackwardAborted:
                    error, mediator.error = mediator.error, None
                    raise error from None
            self.done = True
            for key, _, _ in self.hub.drain():
                mediator.resume(OutOfOrderError(
                    f".grad of a tensor of shape {self.shapes[key]} was never supplied: "
                    f"backward had already passed it when it was requested, or no gradient "
                    f"reaches it from this loss. Gradients flow from the loss back toward the "
                    f"inputs: request them in that order (later layers first)"
                ))
            if mediator.error is not None:
                error, mediator.error = mediator.error, None
                raise error
        finally:
            # This frame is in the traceback of the error raised above: holding the error
            # (here or on the mediator) would be a cycle only the collector frees.
            error = mediator.error = None
            if not mediator.finished:
                mediator.cancel()
            for handle in self.handles:
                handle.remove()
            self.handles.clear()
            self.hub.drain()
            self.exchange = None  # (it serves through this run: a cycle until dropped)
            uninstall("grad")
            runs.remove(self)
            self.mediator = None

    @staticmethod
    def _message(mediator, message, event):
        """The exchange's `message`: the backward body came back with anything but PARKED."""
        if message == DONE or message == FAILED:
            mediator._release()
        if message == FAILED:
            raise _BackwardAborted()
        if message == STOPPED:
            raise InterlaceError("tracer.stop() cannot end a backward pass")

    def _key(self, target):
        """The key of `target` (a tensor the backward pass reaches), hooked once per run."""
        key = self.keys.get(id(target))
        if key is not None:
            return key
        key = len(self.shapes)
        exchange = self.exchange

        def hook(grad):
            event = exchange.handoff(key, grad)
            return event.value if event is not None and event.replaced else None

        try:
            handle = target.register_hook(hook)
        except RuntimeError as error:
            raise InterlaceError(
                f".grad was requested inside `with loss.backward():` for a tensor of shape "
                f"{tuple(target.shape)} that does not require grad ({error}); was the trace run "
                f"under torch.no_grad() or inference_mode()?"
            ) from None
        self.handles.append(handle)
        self.keys[id(target)] = key
        self.shapes.append(None)
        exchange.grow(key + 1)
        self.hub.observe(key)
        return key

    def _request(self, tensor):
        """Body side: the event of the gradient flowing through `tensor`'s batch tensor, and
        `tensor`'s rows of it (None: all of it)."""
        # One invoke's `h` is a view of the batch's tensor, which is what backward reaches.
        batch = origin(tensor)
        target, rows = (tensor, None) if batch is None else batch
        mediator = self.mediator
        event = mediator.event
        if event is not None and self.keys.get(id(target)) == event.key:
            return event, rows
        if self.done:
            raise OutOfOrderError(".grad was requested after the backward pass had finished")
        key = self._key(target)
        self.shapes[key] = tuple(tensor.shape)
        self.hub.park(key, self.hub.so_far(key), mediator)
        mediator.wait(PARKED)
        return mediator.event, rows

    def read(self, tensor):
        event, rows = self._request(tensor)
        return event.value if rows is None else event.value[rows]

    def write(self, tensor, value):
        event, rows = self._request(tensor)
        if rows is None:
            event.value = value
        else:
            if not event.replaced:
                event.value = event.value.clone()  # the gradient torch passed stays intact
            event.value[rows] = value
        event.replaced = True


class _BackwardAborted(BaseException):
    """Unwinds torch's backward after the backward body failed."""


class _BackwardBackend(Backend):
    def __call__(self, tracer):
        values = {}
        GradRun().run(BodyJob(tracer.defer(), values), tracer.tensor, tracer.backward_args,
                      tracer.backward_kwargs)
        tracer.push_result(values)
