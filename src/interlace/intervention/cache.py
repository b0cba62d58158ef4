"""`tracer.cache(...)`: record every module's output (or inputs, or the chosen modules) in one go.

    with model.trace(x) as tracer:
        cache = tracer.cache()                      # declared before the body reads anything
    cache["model.transformer.h.0"].output           # by path
    cache.model.transformer.h[0].output             # or by navigation (`cache.transformer...` too)

A cache is an observer of the interleaver: its recorder runs in the engine's own hook of each
cached location, *after* every body waiting there has been served, so it sees the value with
this trace's edits (and skips) applied, exactly what the model passes on. Each recorded tensor
is a snapshot: detached (by default), moved to `device` (CPU by default), and copied when
that move was a no-op, so a later in-place edit of the live tensor does not reach back into
the cache (nnsight keeps the live tensor when it is already on the target device, so on CPU
its cache shows edits made after the module ran, on a GPU it does not). Objects that are
not tensors (e.g. a transformers KV cache passed as an input) are kept by reference.

Footguns of nnsight's `tracer.cache` fixed here, same call shape:
- a path in `modules=` that names no module raises (nnsight records nothing for it);
- under generation a module's `.output` is always a list, one entry per step, even when the
  generation ran a single step (nnsight gives a bare value then, a list otherwise);
- reading `.inputs` of a cache made without `include_inputs=True` raises instead of
  returning None; iterating the cache yields its paths.

The cache holds no model, Envoy or interleaver: only its entries, the model's module paths
(for navigation) and a weak reference to the root Envoy (for names the Envoy tree resolves
itself, such as aliases), so a saved cache never keeps a model alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from ..errors import CacheError  # re-exported: its home is interlace.errors
from ..tracing import save
from .batching import narrow
from .outputs import rebuild
from .access import module_of
from .envoy import Envoy


class Entry:
    """One visit of a module: its `output` and/or its `inputs` (`(args, kwargs)`)."""

    __slots__ = ("output", "inputs")

    def __init__(self, output=None, inputs=None):
        self.output = output
        self.inputs = inputs

    @property
    def input(self):
        """The first positional argument, else the first keyword argument (as `envoy.input`)."""
        if self.inputs is None:
            return None
        args, kwargs = self.inputs
        if args:
            return args[0]
        return next(iter(kwargs.values()), None)

    def __repr__(self):
        return f"Entry(output={_brief(self.output)}, inputs={_brief(self.inputs)})"


def _brief(value):
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return type(value).__name__


def _apply(value, fn):
    """`value` with `fn` applied to every tensor in it (tuples, lists, dicts, model outputs)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [_apply(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_apply(v, fn) for v in value]
    if isinstance(value, dict):
        out = {k: _apply(v, fn) for k, v in value.items()}
        return out if type(value) is dict else rebuild(value, out)  # (ModelOutputs too)
    return value


def _snapshotter(device, dtype, detach, non_blocking):
    """The per-tensor copy a cache keeps (see the module docstring), and its memo.

    Many modules pass a tensor on unchanged (GPT-2's `mlp.c_proj`, `mlp.dropout` and `mlp`
    output one tensor; the root's logits are `lm_head`'s): a tensor seen again with the same
    version counter (no in-place change since) reuses its copy. The memo holds weak
    references only, so it keeps no activation alive during the run; it is dropped at the
    end of the run (`memo.clear`).
    """
    move = device is not None or dtype is not None
    memo = {}
    ref = weakref.ref

    def copy(t):
        if detach:
            t = t.detach()
        if move:
            out = t.to(device=device, dtype=dtype, non_blocking=non_blocking)
            return out.clone() if out is t else out
        return t.clone()

    def snapshot(t):
        key = id(t)
        try:
            version = t._version
        except RuntimeError:  # an inference-mode tensor has no version counter: always copy
            return copy(t)
        hit = memo.get(key)
        if hit is not None and hit[0]() is t and hit[1] == version:
            return hit[2]
        out = copy(t)
        memo[key] = (ref(t), version, out)
        return out

    return snapshot, memo.clear


class Cache(Mapping):
    """What `tracer.cache()` returns: module path -> `CacheView` of that module's entries.

    A read-only mapping (`keys()`, `items()`, `len()`, iteration: the cached paths in the
    order the run first reached them), also navigable by attribute like the model:
    `cache.model.transformer.h[0].output` or the short `cache.transformer.h[0].output`.
    """

    def __init__(self, paths, root=None, steps=False, include_output=True, include_inputs=False):
        self._entries = {}  # path -> [Entry, ...], in the order the run first reached each path
        self._paths = paths  # every module path of the model, for navigation (strings only)
        self._known = frozenset(paths)
        self._root = weakref.ref(root) if root is not None else None
        self._steps = steps  # a generation: values are always per-step lists
        self._include_output = include_output
        self._include_inputs = include_inputs

    def __getstate__(self):
        # the weak reference to the model cannot be pickled (and a model is not wanted in a
        # `torch.save`d cache): paths navigate without it
        return {**self.__dict__, "_root": None}

    # -- recording (model side) ---------------------------------------------------------

    def _recorder(self, path, slot, rows, total, snapshot):
        """The observer of one location: `fn(occ, value)` appends/fills the visit `occ`."""
        entries = self._entries
        visits = None
        output = slot == "output"

        def record(occ, value):
            nonlocal visits
            if rows is not None:
                value = narrow(value, rows, total)
            value = _apply(value, snapshot)
            if visits is None:
                visits = entries.get(path)
                if visits is None:
                    visits = entries[path] = []
            if occ < len(visits):
                entry = visits[occ]
            else:
                while len(visits) <= occ:  # a visit whose other slot was not recorded
                    visits.append(Entry())
                entry = visits[occ]
            if output:
                entry.output = value
            else:
                entry.inputs = value

        return record

    def _map_tensors(self, fn):
        """Replace every recorded tensor by `fn(tensor)` (scan: fake tensors -> meta)."""
        for visits in self._entries.values():
            for entry in visits:
                entry.output = _apply(entry.output, fn)
                entry.inputs = _apply(entry.inputs, fn)

    # -- the mapping -----------------------------------------------------------------------

    def __getitem__(self, key):
        if not isinstance(key, str):
            raise KeyError(
                f"the cache is keyed by module path (e.g. 'model.transformer.h.0'), not "
                f"{key!r}; navigate by attribute or index from a module: cache.model.transformer.h[0]"
            )
        path = self._resolve(key)
        if path is None:
            raise KeyError(self._unknown(key))
        return CacheView(self, path)

    def __iter__(self):
        return iter(list(self._entries))

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        if not isinstance(key, str):
            return False
        path = self._resolve(key)
        return path is not None and path in self._entries

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name == "model":
            return CacheView(self, "model")
        return getattr(CacheView(self, "model"), name)  # short form: cache.transformer...

    def __dir__(self):
        return sorted(set(super().__dir__()) | {"model"} | set(_children(self._paths, "model")))

    def __repr__(self):
        shown = ", ".join(list(self._entries)[:6])
        more = f", ... ({len(self._entries) - 6} more)" if len(self._entries) > 6 else ""
        return f"<interlace cache of {len(self._entries)} module(s): {shown}{more}>"

    # -- paths -------------------------------------------------------------------------------

    def _resolve(self, key):
        """The module path `key` names ('model.a.b', or 'a.b' relative to the model), or None."""
        if key in self._known:
            return key
        full = "model." + key
        if full in self._known:
            return full
        return self._through_envoy("model", key[len("model."):] if key.startswith("model.") else key)

    def _through_envoy(self, base, rest):
        """Resolve `rest` below `base` with the model's Envoy tree (names it resolves itself)."""
        root = self._root() if self._root is not None else None
        if root is None:
            return None
        node = root
        try:
            for part in base.split(".")[1:]:
                node = getattr(node, part)
            for part in rest.split("."):
                node = getattr(node, part)
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        path = getattr(node, "_path", None)
        return path if path in self._known else None

    def _unknown(self, key):
        return (
            f"{key!r} is not a module path of this model (paths look like "
            f"'model.transformer.h.0'); cached: {', '.join(list(self._entries)[:8]) or '(none)'}"
        )


def _children(paths, path):
    """The names of the direct submodules of `path`, in the model's order."""
    prefix = path + "."
    out = []
    for p in paths:
        if p.startswith(prefix):
            name = p[len(prefix):]
            if "." not in name:
                out.append(name)
    return out


class CacheView:
    """One module of a cache: `.output`, `.inputs`, `.input`, navigation to its submodules.

    A module the run visited once gives its value; several visits (a module called twice, or
    any module under generation: one visit per step) give a list, one value per visit.
    `len(view)` is the number of visits; `view.entries` the `Entry` objects themselves.
    """

    __slots__ = ("_cache", "_path")

    def __init__(self, cache, path):
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_path", path)

    @property
    def path(self):
        return self._path

    @property
    def entries(self):
        """The recorded visits of this module (`Entry(output=..., inputs=...)`), in order."""
        visits = self._cache._entries.get(self._path)
        if visits is None:
            cache = self._cache
            raise KeyError(
                f"{self._path!r} was not cached: it did not run while the cache recorded"
                + ("" if cache._include_output else ", and only inputs were recorded")
                + f" (cached: {len(cache._entries)} module(s), e.g. "
                + f"{', '.join(list(cache._entries)[:4]) or 'none'})"
            )
        return visits

    def _values(self, slot):
        visits = self.entries
        cache = self._cache
        if slot == "output" and not cache._include_output:
            raise CacheError(
                f"{self._path}.output was not recorded: this cache was made with "
                f"include_output=False"
            )
        if slot != "output" and not cache._include_inputs:
            raise CacheError(
                f"{self._path}.{slot} was not recorded: make the cache with "
                f"tracer.cache(include_inputs=True) to record inputs"
            )
        values = [getattr(entry, slot) for entry in visits]
        return values[0] if len(values) == 1 and not cache._steps else values

    @property
    def output(self):
        """The module's output (a list of one per visit when it ran several times)."""
        return self._values("output")

    @property
    def inputs(self):
        """`(args, kwargs)` the module was called with (per visit, as `.output`)."""
        return self._values("inputs")

    @property
    def input(self):
        """The first positional argument, else the first keyword argument (per visit)."""
        return self._values("input")

    def __len__(self):
        return len(self._cache._entries.get(self._path, ()))

    def keys(self):
        """The cached paths at or below this module."""
        prefix = self._path + "."
        return [k for k in self._cache._entries if k == self._path or k.startswith(prefix)]

    def __contains__(self, key):
        """Is `key` (relative to this module, or a full path) a cached module at or below it?"""
        if not isinstance(key, str):
            return False
        cache = self._cache
        path = cache._resolve(f"{self._path}.{key}") or cache._resolve(key)
        return path is not None and path in cache._entries and (
            path == self._path or path.startswith(self._path + ".")
        )

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        cache = self._cache
        path = f"{self._path}.{name}"
        if path not in cache._known:
            path = cache._through_envoy(self._path, name)
        if path is None:
            children = _children(cache._paths, self._path)
            raise AttributeError(
                f"{self._path} has no submodule {name!r} in this cache; its submodules are: "
                f"{', '.join(children) or '(none)'}; a module's values are .output, .inputs, .input"
            )
        return CacheView(cache, path)

    def __getitem__(self, key):
        cache = self._cache
        children = _children(cache._paths, self._path)
        if isinstance(key, str):
            path = cache._resolve(f"{self._path}.{key}")
            if path is None:
                raise KeyError(f"{self._path} has no submodule {key!r}; it has: {', '.join(children)}")
            return CacheView(cache, path)
        if isinstance(key, slice):
            return [CacheView(cache, f"{self._path}.{n}") for n in children[key]]
        try:
            return CacheView(cache, f"{self._path}.{children[key]}")
        except IndexError:
            raise IndexError(
                f"{self._path} has {len(children)} submodule(s); index {key} is out of range"
            ) from None
        except TypeError:
            raise TypeError(f"{self._path} is indexed by int, slice or name, not {key!r}") from None

    def __iter__(self):
        for name in _children(self._cache._paths, self._path):
            yield CacheView(self._cache, f"{self._path}.{name}")

    def __setattr__(self, name, value):
        raise AttributeError("a cache is read-only")

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(_children(self._cache._paths, self._path)))

    def __repr__(self):
        n = len(self)
        return f"<cache of {self._path}: {n} visit(s), {len(self.keys())} cached path(s) at or below>"


def make_cache(tracer, modules=None, device=torch.device("cpu"), dtype=None, detach=True,
               include_output=True, include_inputs=False, non_blocking=False):
    """`tracer.cache(...)` (see `InterleavingTracer.cache`): register a cache on the running body."""
    model = tracer.model
    engine = tracer.engine
    interleaver = engine.active()
    if interleaver is None or interleaver.current is None:
        raise CacheError(
            "tracer.cache() records while the model runs: call it inside the body that runs "
            "with the model (the `with model.trace(x):` body, or an invoke's body: then it "
            "records that invoke's rows), before reading any value"
        )
    mediator = interleaver.mediator("tracer.cache()")
    if interleaver.hub.calls:
        raise CacheError(
            "tracer.cache() must be called before the body reads or edits a model value "
            "(the model has started, and the modules it has run so far cannot be recorded): "
            "move it to the top of the trace body (or of the invoke)"
        )
    if not (include_output or include_inputs):
        raise CacheError("tracer.cache() with include_output=False and include_inputs=False records nothing")
    state = engine.state
    keys = _module_indexes(state, modules)
    generating = bool(getattr(tracer._run, "generates", False))
    cache = Cache(tuple(state.paths), root=model, steps=generating,
                  include_output=include_output, include_inputs=include_inputs)
    snapshot, forget = _snapshotter(device, dtype, detach, non_blocking)
    interleaver.cleanups.append(forget)
    rows, total = mediator.rows, interleaver.total
    for index in keys:
        path = state.paths[index]
        if include_inputs:
            interleaver.observe(2 * index, cache._recorder(path, "inputs", rows, total, snapshot))
        if include_output:
            interleaver.observe(2 * index + 1, cache._recorder(path, "output", rows, total, snapshot))
    return save(cache)


def _module_indexes(state, modules):
    """Module indexes of `modules` (None: all; else Envoys, modules or path strings, or one).

    A container that never runs itself (a `ModuleList`, a `ModuleDict`) stands for its
    children, however it is named (`model.transformer.h`, `"transformer.h"`, in a list or
    alone): its own hooks never fire, so recording it would record nothing.
    """
    if modules is None:
        return range(len(state.modules))
    if isinstance(modules, (str, torch.nn.Module, Envoy)):
        modules = [modules]
    by_path = {path: i for i, path in enumerate(state.paths)}
    out = []
    for item in modules:
        out.extend(_expand(state, _index_of(state, by_path, item)))
    return sorted(set(out))


def _index_of(state, by_path, item):
    """The module index `item` (an Envoy, a module or a path) names; CacheError if none."""
    if isinstance(item, str):
        index = by_path.get(item)
        if index is None:
            index = by_path.get("model." + item)
        if index is None:
            close = [p for p in state.paths if p.endswith("." + item.split(".")[-1])][:5]
            raise CacheError(
                f"tracer.cache(modules=...): {item!r} is not a module path of this model; "
                f"paths look like 'model.transformer.h.0'"
                + (f" (did you mean {', '.join(close)}?)" if close else "")
            )
        return index
    module = module_of(item) if isinstance(item, Envoy) else item
    index = state.index.get(id(module)) if isinstance(module, torch.nn.Module) else None
    if index is None:
        raise CacheError(
            f"tracer.cache(modules=...) takes Envoys (model.transformer.h[0]) or module "
            f"paths ('model.transformer.h.0'); got {type(item).__name__}, which is not "
            f"a module of this model"
        )
    return index


def _expand(state, index):
    """`index`, or the modules a container that never runs stands for (its children, down)."""
    module = state.modules[index]
    if not (_never_runs(module) and module._modules):
        return [index]
    out = []
    for child in module.children():
        child_index = state.index.get(id(child))
        if child_index is not None:
            out.extend(_expand(state, child_index))
    return out


def _never_runs(module):
    """A container whose forward is `nn.Module`'s own (calling it raises): it is never called."""
    return type(module).forward is torch.nn.Module.forward
