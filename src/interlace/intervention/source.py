"""`.source`: the calls and assignments inside a module's `forward`, as locations of a trace.

`model.transformer.h[0].attn.source` names every operation the forward performs, the way
nnsight 0.8.1 names them, and each one has `.output`, `.input`, `.inputs`, `.skip()` and a
nested `.source`, like a module:

- a call `f(...)` is named after the dotted path of `f`: `self.c_fc(x)` -> `self_c_fc`,
  `torch.nn.functional.softmax(x)` -> `torch_nn_functional_softmax`, `x[0].view(...)` ->
  `x_view` (a subscript says where, not what), `self.c_attn(x).split(...)` -> `split` (a
  call on a call's result keeps the attributes after it), nothing to name -> `call`;
- an assignment with one target is named after the target (`attn_output = ...` ->
  `attn_output`, `cache.is_updated[i] = ...` -> `cache_is_updated`; `a, b = e1, e2` element
  by element; other unpacking is not an operation); its `.output` is the value assigned;
- `_0`, `_1`, ... number the operations of one name in the order they run: arguments before
  the call they are passed to, the value before the assignment.

Mechanism (`rewrite.py`, torch-free): the forward's source is read through the tracer core,
parsed, and each operation is routed through a hook (`HOOK.op(site, self, f, ...)`,
`x = HOOK.bind(site, self, v)`), compiled under the original filename at the original lines;
the rewritten code is cached per code object. This module is the runtime: the hooks the
rewritten code calls, installing it while a run uses it, and the `Source` objects.

Policy, where the rewritten code runs:
- A module's forward is rewritten *in place*, only while a trace uses it: its function's
  `__code__` is swapped when a body first uses the module's `.source` in a run, and put back
  when the run ends. In place, because torch fetches `module.forward` before the module's
  pre-hooks run: a body that reads `attn.input` and then `attn.source...` is served inside
  attn's pre-hook, where a new `attn.forward` would come too late, while the function torch
  already holds runs whatever code it has when called. Decorators (transformers'
  `deprecate_kwarg`, the checkpointing wrapper) are peeled: the innermost function is rewritten
  and its wrappers keep calling it; a wrapper that calls several functions it closes over
  (`@dynamic_rope_update`) is rewritten itself, as nnsight does (see `rewrite.peel`). The hook finds the traced module by the forward's first
  argument, so other instances of the class, and other threads, run straight through. After
  the run the original code object is back: raw speed, and coverage/pdb see what they saw
  before. A forward assigned on the instance as a plain function is replaced on the instance
  for the run instead, and so is an object standing in for the class's forward that says so
  with `__wrapped__` (nnsight's controller): its body may be a copy an in-place swap misses.
- A nested `.source` (inside the function an operation calls) is known only when the call
  runs: the body waits for the operation's input, then the operation calls a rewritten *copy*
  of the callee (same globals, closure and defaults; decorators rebuilt around it) for the
  rest of the run.

Each operation is a location with input and output keys in the interleaver
(`Interleaver.add_locations`), so reads, edits, `tracer.iter`, `OutOfOrderError` and
invoke rows work as for modules. An operation whose module (or call) already ran in this run
before its `.source` was first used is numbered as if it had run once per earlier call (so in
generation, occurrence n is step n); touch `envoy.source` at the top of the body for exact
counts of operations that run a varying number of times per call.
"""

from __future__ import annotations

import threading
import types

import torch
from greenlet import getcurrent

from ..errors import InterlaceError, SourceNotAvailable
from . import hooks
from .access import (
    active_interleaver,
    as_inputs,
    first_input,
    index_of,
    module_of,
    running_interleaver,
    with_first_input,
)
from .batching import swap
from .rewrite import compiled_for as _rewritten
from .rewrite import peel, rebuild

_get_ident = threading.get_ident
_COPY_OF = "__interlace_copy_of__"  # on a rewritten copy installed on an instance: the original
_LOCK = threading.Lock()
_SWAPPED = {}  # function -> [users, its own code]: functions running rewritten code right now


def compiled_for(function, what):
    """`rewrite.compiled_for` of the code `function` had before a run swapped its own in."""
    entry = _SWAPPED.get(function)
    return _rewritten(function, what, entry[1] if entry is not None else None)


class _Assign:
    """The callee recorded for an assignment: it calls nothing."""

    def __repr__(self):
        return "<assignment>"


_ASSIGN = _Assign()


# -- swapping a forward's code in place, for the runs that use it -------------------------------


def _swap_in(function, code):
    with _LOCK:
        entry = _SWAPPED.get(function)
        if entry is None:
            _SWAPPED[function] = [1, function.__code__]
            function.__code__ = code
        else:
            entry[0] += 1


def _swap_out(function):
    with _LOCK:
        entry = _SWAPPED[function]
        entry[0] -= 1
        if not entry[0]:
            function.__code__ = entry[1]
            del _SWAPPED[function]


# -- the hooks the rewritten code calls (model side) --------------------------------------------


class _SharedHook:
    """The hook of a forward rewritten in place: finds the traced instance by its receiver."""

    __slots__ = ("runs",)

    def __init__(self):
        self.runs = {}  # id(receiver) -> _Run, only while a run uses it

    def op(self, site, receiver, fn, /, *args, **kwargs):
        run = self.runs.get(id(receiver))
        if run is None or run.receiver is not receiver:
            return fn(*args, **kwargs)
        return run.call(site, fn, args, kwargs)

    def bind(self, site, receiver, value, /):
        run = self.runs.get(id(receiver))
        if run is None or run.receiver is not receiver:
            return value
        return run.call(site, _ASSIGN, (value,), {})


class _RunHook:
    """The hook of a rewritten copy made for one run (a drilled-into call)."""

    __slots__ = ("run",)

    def __init__(self, run):
        self.run = run

    def op(self, site, receiver, fn, /, *args, **kwargs):
        run = self.run
        if run is None:
            return fn(*args, **kwargs)
        return run.call(site, fn, args, kwargs)

    def bind(self, site, receiver, value, /):
        run = self.run
        if run is None:
            return value
        return run.call(site, _ASSIGN, (value,), {})


class _Drill:
    """A call an operation makes, replaced for the run by a rewritten copy of its function."""

    __slots__ = ("function", "owner", "copy", "run")

    def __init__(self, function, owner, copy, run):
        self.function = function  # what the operation called (a bound method's function)
        self.owner = owner  # the bound instance, or None for a plain function
        self.copy = copy
        self.run = run

    def replace(self, fn):
        owner = self.owner
        if owner is None:
            return self.copy if fn is self.function else fn
        if fn is owner or (getattr(fn, "__func__", None) is self.function
                           and getattr(fn, "__self__", None) is owner):
            return types.MethodType(self.copy, owner)
        return fn


class _Run:
    """One forward's (or one drilled-into call's) operations in one running trace."""

    __slots__ = ("interleaver", "base", "compiled", "receiver", "prefix", "drills", "skips",
                 "callee")

    def __init__(self, interleaver, base, compiled, receiver, prefix):
        self.interleaver = interleaver
        self.base = base  # key of operation i's input: base + 2 * i; its output: + 1
        self.compiled = compiled
        self.receiver = receiver
        self.prefix = prefix
        self.drills = {}  # site -> _Drill
        self.skips = {}  # site -> [(rows, value)] for its next run
        self.callee = None  # what the operation being handed over calls (for drilling)

    def call(self, site, fn, args, kwargs):
        """Run operation `site` (`fn(*args, **kwargs)`, or an assignment) with handoffs."""
        il = self.interleaver
        if il.current is not None or il.bypass or il.hub is None or _get_ident() != il.thread:
            return args[0] if fn is _ASSIGN else fn(*args, **kwargs)
        key = self.base + 2 * site
        self.callee = fn
        args, kwargs = il.handoff(key, (args, kwargs))
        pending = self.skips.pop(site, None) if self.skips else None
        if pending is not None and all(rows is None for rows, _ in pending):
            value = pending[-1][1]  # skipped: the call does not run
        else:
            if fn is _ASSIGN:
                value = args[0]
            else:
                if self.drills:
                    drill = self.drills.get(site)
                    if drill is not None:
                        fn = drill.replace(fn)
                value = fn(*args, **kwargs)
            if pending is not None:  # skipped for some invokes' rows only
                for rows, new in pending:
                    value = new if rows is None else swap(value, new, rows, il.total)
        return il.handoff(key + 1, value)

    def close(self):
        self.drills = {}
        self.skips = {}
        self.callee = None


# -- installing, per run ------------------------------------------------------------------------


def _forward_of(module, what):
    """(function that runs as `module`'s forward, the receiver it gets, or None for none)."""
    function, receiver, _ = _forward_info(module, what)
    return function, receiver


def _forward_info(module, what):
    """`_forward_of`, and whether the instance forward is an object standing in for the
    class's forward (so the rewritten one replaces it on the instance for the run)."""
    forward = hooks.forward_of(module)  # (inside the run's Tap, if it has one)
    if forward is not None and "_hf_hook" in module.__dict__:
        # accelerate's alignment wrapper: the real forward is kept as `_old_forward`
        forward = module.__dict__.get("_old_forward", forward)
    stand_in = False
    if forward is None:
        function, receiver = type(module).forward, module
    elif isinstance(forward, types.MethodType):
        function, receiver = forward.__func__, forward.__self__
    elif isinstance(forward, types.FunctionType):
        function, receiver = forward, None
    elif getattr(forward, "__wrapped__", None) is type(module).forward:
        # a callable object that calls the class's forward with the module and says so with
        # `functools.update_wrapper` (nnsight's controller, installed by `nnsight.NNsight`)
        function, receiver, stand_in = type(module).forward, module, True
    else:
        function, receiver = forward, None
    # a copy this module runs for a trace in progress stands for the function it copies
    function = getattr(function, _COPY_OF, function)
    if not isinstance(function, types.FunctionType):
        raise SourceNotAvailable(
            f"{what}: .source needs a forward written in Python, and this forward is "
            f"{type(function).__name__} {function!r} (a builtin, C or compiled function, or "
            f"an object that does not say which forward it calls with `__wrapped__`)"
        )
    return function, receiver, stand_in


def module_source(envoy):
    """`envoy.source`: the forward's operations. Inside a running body it is installed now,
    so that operations are counted from before the module first runs."""
    module = module_of(envoy)
    what = f"{envoy.path} ({type(module).__name__})"
    function, _ = _forward_of(module, what)
    inner, _ = peel(function)
    compiled = compiled_for(inner, what)
    interleaver = active_interleaver(envoy)
    if (interleaver is not None and interleaver.current is not None
            and interleaver.current.worker is getcurrent()):
        _module_run(interleaver, envoy, compiled)
    return Source(envoy, compiled, f"{envoy.path}.source")


def _names(prefix, compiled):
    return [f"{prefix}.{name}.{part}" for name in compiled.names for part in ("input", "output")]


def _align(hub, base, count, before):
    """Number added locations as if they had run once per earlier call (see module doc)."""
    if before > 0:
        for key in range(base, base + count):
            hub.counts[key] = before


def _module_run(il, envoy, compiled):
    """The module's operations in run `il`, installing the rewritten forward on first use."""
    runs = il.extensions.setdefault("source", {})
    index = index_of(envoy)
    owner = ("forward", index, compiled.original)
    run = runs.get(owner)
    if run is not None:
        return run
    prefix = f"{envoy.path}.source"
    mediator = il.mediator(prefix)
    module = module_of(envoy)
    what = f"{envoy.path} ({type(module).__name__})"
    function, receiver, stand_in = _forward_info(module, what)
    inner, chain = peel(function)
    if compiled_for(inner, what) is not compiled:
        raise InterlaceError(
            f"{what}: its forward was replaced after this .source was read; read "
            f"{envoy.path}.source again"
        )
    if receiver is not None and compiled.receiver is None:
        raise SourceNotAvailable(
            f"{what}: .source needs a forward whose first parameter is the module (`self`); "
            f"{inner.__qualname__} takes none"
        )
    names = _names(prefix, compiled)
    key = 2 * index
    base = il.add_locations(owner, names, within=key)
    run = _Run(il, base, compiled, receiver, prefix)
    hub = il.hub
    before = hub.so_far(key)
    event = mediator.event
    if before and event is not None and event.key == key and event.occ == before - 1:
        before -= 1  # served inside its pre-hook: this call's forward has not started yet
    _align(hub, base, len(names), before)

    if receiver is not None and not stand_in:
        hook, code = compiled.shared(_SharedHook)
        _swap_in(inner, code)
        hook.runs[id(receiver)] = run

        def undo():
            if hook.runs.get(id(receiver)) is run:
                del hook.runs[id(receiver)]
            _swap_out(inner)
            run.close()
    else:
        # A plain function set on the instance, or an object standing in for the forward
        # (whose own body may be another library's rewritten copy, which an in-place swap
        # would not reach): replace it on the instance for the run, and put it back after.
        hook = _RunHook(run)
        copy = rebuild(chain, compiled.function(inner, hook))
        setattr(copy, _COPY_OF, function)
        hooks.mark(copy)  # installed by the run, not a user's replacement
        installed = copy if receiver is None else types.MethodType(copy, receiver)
        previous = hooks.forward_of(module)
        hooks.set_forward(module, installed)

        def undo():
            if hooks.forward_of(module) is installed:
                hooks.set_forward(module, previous)
            hook.run = None
            run.close()

    il.cleanups.append(undo)
    runs[owner] = run
    return run


def _callee_of(fn, op, state):
    """(function, bound owner or None) that operation `op` calls; SourceNotAvailable if none."""
    if fn is _ASSIGN:
        raise SourceNotAvailable(
            f"{op.path} is an assignment, not a call: there is no function to look into "
            f"(its .output is the value assigned)"
        )
    if isinstance(fn, torch.nn.Module):
        index = state.index.get(id(fn))
        use = f"{state.paths[index]}.source" if index is not None else "that submodule's .source"
        raise SourceNotAvailable(
            f"{op.path} calls a submodule ({type(fn).__name__}): use {use} to see inside it"
        )
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        return fn.__func__, fn.__self__
    if isinstance(fn, types.FunctionType):
        return fn, None
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType) and not isinstance(fn, type):
        return call, fn
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    raise SourceNotAvailable(
        f"{op.path} calls {name}, which is not written in Python (a builtin, a C function or "
        f"a class): there is no source to look into"
    )


# -- what a body sees ---------------------------------------------------------------------------


class Source:
    """A forward's operations by name: `envoy.source.<name>` is a `SourceEnvoy`.

    `print(envoy.source)` shows the source with each operation's name at its line;
    iterating yields the operations in the order they run.
    """

    __slots__ = ("_envoy", "_compiled", "_prefix", "_parent")

    def __init__(self, envoy, compiled, prefix, parent=None):
        self._envoy = envoy
        self._compiled = compiled
        self._prefix = prefix
        self._parent = parent  # the SourceEnvoy whose call this is the inside of, or None

    @property
    def names(self):
        """The operations' names, in the order they run."""
        return self._compiled.names

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        site = self._compiled.sites.get(name)
        if site is None:
            import difflib  # only on this error path

            names = self._compiled.names
            close = difflib.get_close_matches(name, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise AttributeError(
                f"{self._prefix} has no operation {name!r}{hint} Its operations: "
                f"{', '.join(names) or '(none)'} (print({self._prefix}) shows each at its line)"
            )
        return SourceEnvoy(self, name, site)

    def __iter__(self):
        for site, name in enumerate(self._compiled.names):
            yield SourceEnvoy(self, name, site)

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(self._compiled.names))

    def __repr__(self):
        return _listing(self._compiled)

    def _run(self, il):
        if self._parent is None:
            return _module_run(il, self._envoy, self._compiled)
        run = self._parent._drill(il).run
        if run.compiled is not self._compiled:
            raise InterlaceError(
                f"{self._prefix}: the call now runs a different function "
                f"({run.compiled.original.co_name}); read {self._prefix} again"
            )
        return run


class SourceEnvoy:
    """One operation inside a forward: `.output`, `.input`, `.inputs`, `.skip()`, `.source`."""

    __slots__ = ("_owner", "_site", "name", "path")

    def __init__(self, owner, name, site):
        self._owner = owner
        self._site = site
        self.name = name
        self.path = f"{owner._prefix}.{name}"

    def _locate(self, what):
        """(interleaver, run) of the running trace, or the Envoy's error outside one."""
        envoy = self._owner._envoy
        il = running_interleaver(envoy, f"{self.path[len(envoy.path) + 1:]}.{what}")
        return il, self._owner._run(il)

    @property
    def output(self):
        """The operation's return value (an assignment's: the value assigned)."""
        il, run = self._locate("output")
        return il.read(run.base + 2 * self._site + 1)

    @output.setter
    def output(self, value):
        il, run = self._locate("output")
        il.write(run.base + 2 * self._site + 1, value)

    @property
    def inputs(self):
        """`(args, kwargs)` the operation is called with (an assignment: `((value,), {})`)."""
        il, run = self._locate("inputs")
        args, kwargs = il.read(run.base + 2 * self._site)
        return args, kwargs

    @inputs.setter
    def inputs(self, value):
        value = as_inputs(value, self.path)
        il, run = self._locate("inputs")
        il.write(run.base + 2 * self._site, value)

    @property
    def input(self):
        """The first positional argument, else the first keyword argument."""
        il, run = self._locate("input")
        return first_input(il.read(run.base + 2 * self._site), self.path)

    @input.setter
    def input(self, value):
        il, run = self._locate("input")
        key = run.base + 2 * self._site
        il.write(key, with_first_input(il.read(key), value, self.path))

    def skip(self, value):
        """The operation does not run at the bound occurrence; `value` is its output."""
        il, run = self._locate("skip()")
        mediator = il.mediator(f"{self.path}.skip()")
        il.request(run.base + 2 * self._site, mediator)
        run.skips.setdefault(self._site, []).append((mediator.rows, value))
        il.skipped = True  # a skipped call may skip modules: do not learn this run's order

    @property
    def source(self):
        """The operations inside the function this operation calls (inside a trace only)."""
        envoy = self._owner._envoy
        il = active_interleaver(envoy)
        if il is None or il.current is None:
            raise SourceNotAvailable(
                f"{self.path}.source is only available inside a trace: which function a call "
                f"runs is known when it runs; use it inside `with model.trace(...)`"
            )
        drill = self._drill(il)
        return Source(envoy, drill.run.compiled, f"{self.path}.source", parent=self)

    def _drill(self, il):
        """This operation's callee, rewritten for the run (waits for the call to start)."""
        run = self._owner._run(il)
        site = self._site
        drill = run.drills.get(site)
        if drill is not None:
            return drill
        mediator = il.mediator(f"{self.path}.source")
        key = run.base + 2 * site
        event = il.request(key, mediator)
        drill = run.drills.get(site)  # another invoke's body may have drilled meanwhile
        if drill is not None:
            return drill
        function, owner = _callee_of(run.callee, self, il.state)
        inner, chain = peel(function)
        compiled = compiled_for(inner, self.path)
        prefix = f"{self.path}.source"
        names = _names(prefix, compiled)
        base = il.add_locations((key, compiled.original), names)
        nested = _Run(il, base, compiled, None, prefix)
        _align(il.hub, base, len(names), event.occ)
        hook = _RunHook(nested)
        drill = _Drill(function, owner, rebuild(chain, compiled.function(inner, hook)), nested)
        run.drills[site] = drill

        def undo():
            hook.run = None
            nested.close()

        il.cleanups.append(undo)
        return drill

    def __repr__(self):
        return _window(self.path, self._owner._compiled, self.name)


# -- printing -----------------------------------------------------------------------------------


def _listing(compiled):
    """The function's source with each operation's name at its line (nnsight's layout).

    The first line (a decorator, or the def) is marked `*`; the lines after it are numbered
    from 0; operations sharing a line continue on `+` lines below it.
    """
    names = compiled.names
    width = max((len(n) for n in names), default=0)
    lines = compiled.text.split("\n")
    by_line = {}
    for name in names:
        by_line.setdefault(compiled.lines[name] - 2, []).append(name)
    out = [" " * (width + 6) + "* " + lines[0]]
    for i, line in enumerate(lines[1:]):
        here = by_line.get(i)
        if not here:
            out.append(" " * (width + 4) + f"{i:3d} {line}")
            continue
        out.append(f" {here[0]:{width}} ->{i:3d} {line}")
        indent = line[: len(line) - len(line.lstrip())]
        for name in here[1:]:
            out.append(f" {name:{width}} ->  + {indent}...")
    return "\n".join(out)


def _window(path, compiled, name):
    """A few lines around one operation, its line marked `--> ... <--` (nnsight's layout)."""
    lines = compiled.text.split("\n")
    at = compiled.lines[name] - 2
    start = max(0, at - 5)
    end = min(len(lines) - 1, at + 8)
    out = [path + ":\n"]
    if start != 0:
        out.append("    ....")
    for i in range(start, end):
        if i == at + 1:
            out.append(f"    --> {lines[i][4:]} <--")
        else:
            out.append("    " + lines[i])
    if end != len(lines) - 1:
        out.append("    ....")
    return "\n".join(out)
