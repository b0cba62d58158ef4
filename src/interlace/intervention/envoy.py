"""The Envoy tree: a proxy per submodule, through which a trace body reads and edits values.

`model.transformer.h[0].mlp` walks the tree the way the module's attributes do; anything
that is not a submodule falls through to the module itself. An Envoy installs nothing on its
module: outside a trace the model is exactly the module the user gave us (no hooks, its own
`forward`), and inside a trace only the locations a body asks for get hooked.

The tree has no reference cycle, so a wrapped model is freed by reference counting alone
(on a GPU its memory comes back the moment the user's last reference goes, not at the next
cyclic collection): the root holds its children (a cache), and each child holds only its
module and the model's `Engine` (which holds modules, never Envoys), not its root. A
child therefore keeps working when the user holds it alone (`layer = model.transformer.h[0]`,
then `del model`); it still needs a trace of its model to read values, and a trace holds the
model for as long as it runs.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .._native import hotpath
from ..errors import InterlaceError, NotInTraceError
from ..tracing.generators import Ready
from . import attach
from .access import active_interleaver, as_inputs, first_input, running_interleaver, with_first_input
from .engine import Engine
from .iteration import Indexer, Iteration
from .source import module_source


# The class a root made as `Envoy(module)` becomes (nnsight 0.8 lets users trace an Envoy
# directly): `models.Model`, which registers itself here so that this layer never imports
# `models`.
ROOT_CLASS: list = []

# Prefix for a submodule whose name an Envoy serves itself (BERT's `output`): `.E_output`.
COLLISION_PREFIX = "E_"


class Envoy:
    """A submodule seen from a trace body: `.output`, `.input`, `.inputs`, `.skip()`.

    `Envoy(module)` makes a traceable root (a `Model`); children are Envoys too. Links up
    the tree (`parent`, `root`) are weak: the tree is owned top-down, so dropping the root
    frees the model by reference counting.
    """

    def __new__(cls, module=None, *args, _engine=None, **kwargs):
        if cls is Envoy and _engine is None and ROOT_CLASS:
            cls = ROOT_CLASS[0]  # `Envoy(module)`: a root that can trace
        return object.__new__(cls)

    def __init__(self, module: torch.nn.Module, path: str = "model", *, _engine=None, _index=0,
                 _parent=None):
        if _engine is None:  # a root made without `models` loaded: it has a tree, no trace()
            _engine = Engine(module)
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_engine", _engine)  # the model's Engine (no Envoy in it)
        object.__setattr__(self, "_index", _index)
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_parent", None if _parent is None else weakref.ref(_parent))

    def __bool__(self):
        # Without it `bool()` falls back to `__len__` (the number of submodules), so a leaf
        # would be falsy and `if model.transformer.h[0].mlp.c_fc:` would take the else branch.
        return True

    # -- the tree ----------------------------------------------------------------------------

    def _child(self, name):
        child = self._children.get(name)
        if child is None:
            module = self._module._modules[name]
            engine = self._engine
            index = engine.state.index.get(id(module))
            # A module reachable at two paths has one Envoy, at its first path (as torch's
            # named_modules lists it), whichever path the user walks first.
            child = engine.envoys.get(index) if index is not None else None
            if child is None:
                path = engine.state.paths[index] if index is not None else f"{self._path}.{name}"
                # (a module added after wrapping is an attachment: attach.py)
                cls = _envoy_class(engine.envoy_classes, module, path) if index is not None else Attached
                child = cls(module, path, _engine=engine, _index=index, _parent=self)
                if index is not None:
                    engine.envoys[index] = child
            self._children[name] = child
        return child

    def __getattr__(self, name):
        # Only called when normal lookup fails: submodules first, then aliases (rename=),
        # then the module's attributes.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        module = self.__dict__.get("_module")
        if module is None:
            raise AttributeError(name)
        if name in module._modules and module._modules[name] is not None:
            child = self._child(name)
            # next time a plain attribute hit (a submodule replaced later is not followed)
            self.__dict__[name] = child
            return child
        if name.startswith(COLLISION_PREFIX):
            real = name[len(COLLISION_PREFIX):]
            if module._modules.get(real) is not None and real in SERVED:
                return self._child(real)  # BERT's `output` submodule, as `.E_output`
        aliases = self._engine.aliases.get(self._path)
        if aliases and name in aliases:
            return self.get(aliases[name])
        try:
            return getattr(module, name)
        except AttributeError:
            children = [n for n, m in module._modules.items() if m is not None]
            raise AttributeError(
                f"{self._path} ({type(module).__name__}) has no submodule or attribute "
                f"{name!r}; its submodules are: {', '.join(children) or '(none)'}"
            ) from None

    def __setattr__(self, name, value):
        if name in type(self).__dict__ or name in Envoy.__dict__ or name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._module, name, value)
            self.__dict__.pop(name, None)  # a cached child Envoy of that name is stale now
            self._children.pop(name, None)
            self.__dict__.pop("_positions", None)  # (and `h[i]`'s Envoys)

    # `envoy[i]` on a ModuleList or Sequential: (a copy of its `_modules`, the names of its
    # non-empty slots in order, their Envoys once looked up), so that `h[i]` finds its child
    # with one dict comparison (identity per slot) instead of scanning the slots for None and
    # listing the names. Those containers renumber (a new dict) or change a slot's module on
    # every edit torch offers, which the comparison sees (and a child set through the Envoy
    # drops the copy: `__setattr__`); other modules list their names on each call.
    _positions = None

    def _getitem(self, key):
        """`envoy[key]` (`__getitem__`, compiled: `hotpath.envoy_indexer`, set below the class,
        serves a kept child itself): makes the child Envoys, keeps their positions, explains."""
        fields = self.__dict__  # (one lookup: an Envoy's attribute reads are not specialized)
        module = fields["_module"]
        if type(key) is int:  # the common `h[i]`
            modules = module._modules
            positions = fields.get("_positions")
            if positions is None or positions[0] != modules:
                positions = _index_positions(self, modules)
            try:
                child = positions[2][key]
            except IndexError:
                pass  # the message below
            else:
                if child is None:
                    child = positions[2][key] = self._child(positions[1][key])
                return child
        names = [n for n, m in module._modules.items() if m is not None]
        if isinstance(key, slice):
            return [self._child(n) for n in names[key]]
        if isinstance(key, str):
            if key in module._modules:
                return self._child(key)
            raise KeyError(f"{self._path} has no submodule {key!r}; it has: {', '.join(names)}")
        try:
            return self._child(names[key])
        except IndexError:
            raise IndexError(
                f"{self._path} has {len(names)} submodule(s); index {key} is out of range"
            ) from None
        except TypeError:
            raise TypeError(f"{self._path} is indexed by int, slice or name, not {key!r}") from None

    def __iter__(self):
        for name, module in self._module._modules.items():
            if module is not None:
                yield self._child(name)

    def __len__(self):
        return len([m for m in self._module._modules.values() if m is not None])

    def __repr__(self):
        aliases = self._engine.aliases
        if not aliases:
            return repr(self._module)
        return _repr_with_aliases(self._module, self._path, aliases)

    # -- the tree as data: what scripts walk ---------------------------------------------------

    @property
    def path(self) -> str:
        """The module's dotted path from the root, `"model"` for the root itself."""
        return self._path

    @property
    def parent(self):
        """The Envoy this one was reached from (None for the root, or once the root is gone)."""
        parent = self._parent
        return None if parent is None else parent()

    @property
    def root(self):
        """The top of the tree this Envoy belongs to (the wrapped model while it lives)."""
        envoy = self
        while (parent := envoy.parent) is not None:
            envoy = parent
        return envoy

    def get(self, path: str):
        """The Envoy (or, inside a trace, the value) at dotted `path` below this one:
        `model.get("transformer.h.0.mlp")`, `model.get("transformer.h.0.mlp.output")`."""
        found = self
        for part in path.split("."):
            if part.lstrip("-").isdigit() and isinstance(found, Envoy):
                found = found[int(part)]
            else:
                found = getattr(found, part)
        return found

    def modules(self, include_fn=None, names=False) -> list:
        """Every Envoy of this subtree, children before their parent (nnsight's order); a
        module reachable at two paths is listed once. `include_fn(envoy)` filters;
        `names=True` gives `(path, envoy)` pairs."""
        result, seen, stack = [], set(), [(self, False)]
        while stack:
            envoy, expanded = stack.pop()
            if expanded:
                if include_fn is None or include_fn(envoy):
                    result.append((envoy.path, envoy) if names else envoy)
                continue
            if id(envoy) in seen:
                continue
            seen.add(id(envoy))
            stack.append((envoy, True))
            stack.extend((child, False) for child in reversed(list(envoy)))
        return result

    def named_modules(self, include_fn=None) -> list:
        """`modules(include_fn, names=True)`: `(path, envoy)` pairs."""
        return self.modules(include_fn=include_fn, names=True)

    @property
    def device(self):
        """The device of the module's first parameter (None when it has none)."""
        for parameter in self._module.parameters():
            return parameter.device
        return None

    @property
    def devices(self) -> set:
        """Every device the module's parameters live on."""
        return {parameter.device for parameter in self._module.parameters()}

    def to(self, *args, **kwargs):
        """Move the module (in place, as torch does); returns this Envoy, not the module."""
        self._module.to(*args, **kwargs)
        return self

    def cpu(self, *args, **kwargs):
        self._module.cpu(*args, **kwargs)
        return self

    def cuda(self, *args, **kwargs):
        self._module.cuda(*args, **kwargs)
        return self

    # -- deprecated spellings nnsight 0.8 still accepts ----------------------------------------

    @property
    def iter(self):
        """Deprecated: `tracer.iter[...]` (this is the running trace's)."""
        warnings.warn("model.iter is deprecated; use tracer.iter", DeprecationWarning, stacklevel=2)
        return Indexer(self._running_mediator)

    def all(self):
        """Deprecated: `tracer.all()` (this is the running trace's)."""
        warnings.warn("model.all() is deprecated; use tracer.all()", DeprecationWarning, stacklevel=2)
        return Iteration(self._running_mediator, slice(None), text="all()")

    def _running_mediator(self, what):
        interleaver = self._engine.active()
        if interleaver is None or interleaver.current is None:
            raise NotInTraceError(f"{what} works only inside the body of a running trace")
        return interleaver.mediator(what)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._module._modules) | set(dir(self._module)))

    # -- inside a trace ------------------------------------------------------------------------

    # the running trace, for the properties below and for `eproperty` (see access.py)
    _active = active_interleaver
    _interleaver = running_interleaver

    @property
    def output(self):
        """The module's output at the bound occurrence (a real value: the model waits)."""
        fields = self.__dict__  # (one lookup: an Envoy's attribute reads are not specialized)
        interleaver = fields["_engine"].running  # inline: the hottest read of a body
        if interleaver is None:
            interleaver = self._interleaver("output")  # raises: no trace running
        return interleaver.read(2 * fields["_index"] + 1)

    @output.setter
    def output(self, value):
        interleaver = self._engine.running
        if interleaver is None:
            interleaver = self._interleaver("output")  # raises: no trace running
        interleaver.write(2 * self._index + 1, value)

    @property
    def inputs(self):
        """`(args, kwargs)` the module is called with at the bound occurrence."""
        args, kwargs = self._interleaver("inputs").read(2 * self._index)
        return args, kwargs

    @inputs.setter
    def inputs(self, value):
        self._interleaver("inputs").write(2 * self._index, as_inputs(value, self._path))

    @property
    def input(self):
        """The first positional argument, else the first keyword argument (Llama's layers)."""
        return first_input(self._interleaver("input").read(2 * self._index), self._path)

    @input.setter
    def input(self, value):
        interleaver = self._interleaver("input")
        inputs = interleaver.read(2 * self._index)
        interleaver.write(2 * self._index, with_first_input(inputs, value, self._path))

    # -- the same, for a body running as a generator (tracing/generators.py) ------------------

    # `__interlace_read__(self, name)`, `self.<name>` in a generator body: an iterator that
    # yields while the model has not produced the value yet, and returns it
    # (tracing/generators.py). Its common case, `.output` of a running model, is compiled
    # (`hotpath.envoy_reader`, set below the class); everything else is `_interlace_read`.

    def _interlace_read(self, name):
        """`__interlace_read__`'s policy: every read it does not serve itself. A subclass's
        own `output`/`input`/`inputs` is read as it is."""
        fields = self.__dict__
        engine = fields["_engine"]
        # an express run serves the read itself (express.py), else the running trace
        # (`general_run`: `Engine.running` less its express check, made here already)
        interleaver = engine.express or engine.general_run
        if interleaver is not None:
            if name == "output":
                if type(self).output is _OUTPUT:
                    return interleaver.reader(2 * fields["_index"] + 1)  # (hotpath.Exchange.reader)
            elif name in _ENVOY_READS and getattr(type(self), name) is _ENVOY_READS[name]:
                return self._inputs_read(interleaver, name)
        return Ready(getattr(self, name))

    def _inputs_read(self, interleaver, name):
        inputs = yield from interleaver.generator_read(2 * self._index)
        if name == "inputs":
            args, kwargs = inputs
            return args, kwargs
        return first_input(inputs, self._path)

    def _interlace_write(self, name, value):
        """`__interlace_write__`'s policy, `self.<name> = value` in a generator body (see
        `__interlace_read__`): every assignment the compiled one (`hotpath.envoy_writer`,
        set below the class: `.output` in an express run) does not make itself."""
        engine = self._engine
        interleaver = engine.express or engine.general_run  # (see `__interlace_read__`)
        if interleaver is None or getattr(type(self), name, None) is not _ENVOY_READS.get(name):
            setattr(self, name, value)
            return Ready(None)
        key = 2 * self._index
        if name == "output":
            return interleaver.generator_write(key + 1, value)
        if name == "inputs":
            return interleaver.generator_write(key, as_inputs(value, self._path))
        return self._input_write(interleaver, key, value)

    def _input_write(self, interleaver, key, value):
        inputs = yield from interleaver.generator_read(key)
        yield from interleaver.generator_write(key, with_first_input(inputs, value, self._path))

    def skip(self, value):
        """The module does not run at the bound occurrence; `value` is its output instead."""
        self._interleaver("skip()").skip(self._index, value)

    @property
    def source(self):
        """The calls and assignments inside this module's forward, by name, each with
        `.output`/`.input`/`.inputs`/`.skip()` like a module; `print` it to see the names
        (see intervention/source.py)."""
        return module_source(self)

    def __call__(self, *args, hook=False, **kwargs):
        """Run the module. Inside a trace body it runs as a plain module (no hooks fire);
        `hook=True` runs a module attached after wrapping *watched*: its internals are
        locations of the run, as nnsight's `envoy(x, hook=True)` (see attach.py)."""
        interleaver = self._engine.active()
        if interleaver is not None and interleaver.current is not None:
            module = self._module
            if hook and attach.is_attached(interleaver, module):
                return attach.call(interleaver, module, self._path, args, kwargs)
            return interleaver.call_plain(module, args, kwargs)
        return self._module(*args, **kwargs)


_ENVOY_READS = {name: Envoy.__dict__[name] for name in ("output", "input", "inputs")}
"""The properties `Envoy.__interlace_read__` serves (a subclass's own are read as they are)."""
_OUTPUT = _ENVOY_READS["output"]
Envoy.__interlace_read__ = hotpath.envoy_reader(_OUTPUT, Envoy._interlace_read)
Envoy.__getitem__ = hotpath.envoy_indexer(Envoy._getitem)
Envoy.__interlace_write__ = hotpath.envoy_writer(_OUTPUT, Envoy._interlace_write)


class Attached(Envoy):
    """The Envoy of a module added to the tree after wrapping (an adapter, a LoRA, an SAE):
    its values are those of the calls a body makes as `envoy(x, hook=True)`, per invoke
    (attach.py). `skip()` and `.source` are not supported on it."""

    def _event(self, what, which):
        interleaver = self._engine.running
        if interleaver is None:
            raise attach.not_watched(self._path, what)
        mediator = interleaver.mediator(f"{self._path}.{what}")
        key = attach.key(interleaver, self._module, self._path, mediator.rows) + which
        return interleaver.request(key, mediator)

    @property
    def output(self):
        return self._event("output", 1).value

    @output.setter
    def output(self, value):
        event = self._event("output", 1)
        event.value = value
        event.replaced = True

    @property
    def inputs(self):
        args, kwargs = self._event("inputs", 0).value
        return args, kwargs

    @inputs.setter
    def inputs(self, value):
        event = self._event("inputs", 0)
        event.value = as_inputs(value, self._path)
        event.replaced = True

    @property
    def input(self):
        return first_input(self._event("input", 0).value, self._path)

    @input.setter
    def input(self, value):
        event = self._event("input", 0)
        event.value = with_first_input(event.value, value, self._path)
        event.replaced = True

    def skip(self, value):
        raise InterlaceError(
            f"{self._path}.skip(): {self._path} was added to the model after it was wrapped "
            f"(an attachment): instead of skipping it, do not call it"
        )


def _index_positions(envoy, modules):
    """`envoy._positions` made from `modules` now (kept for ModuleList and Sequential). A
    child Envoy kept for a slot whose module changed (set on the torch module) is dropped."""
    fields = envoy.__dict__
    children = fields["_children"]
    for name in [n for n, child in children.items() if modules.get(n) is not child._module]:
        del children[name]
        fields.pop(name, None)
    names = tuple(n for n, m in modules.items() if m is not None)
    positions = (dict(modules), names, [None] * len(names))
    if isinstance(envoy._module, (torch.nn.ModuleList, torch.nn.Sequential)):
        object.__setattr__(envoy, "_positions", positions)
    return positions


def child_of(envoy, name):
    """The Envoy of `envoy`'s submodule `name` (by its attribute name in the module)."""
    return envoy._child(name)


# Names an Envoy serves itself: a submodule called so is reached as `.E_<name>` instead.
SERVED = frozenset(name for name in dir(Envoy) if not name.startswith("_"))


def _envoy_class(mapping, module, path):
    """The Envoy class for `module` at `path` under `Model(..., envoys=mapping)`: one class for
    every module, or a dict keyed by module class (its MRO is tried) or by path suffix
    (component-wise, `*` for any one part: `"attn"`, `"h.*"`)."""
    if mapping is None or isinstance(mapping, type):
        return mapping or Envoy
    for cls in type(module).__mro__:
        if cls in mapping:
            return mapping[cls]
    parts = path.split(".")
    for key, cls in mapping.items():
        if isinstance(key, str):
            wanted = key.strip(".").split(".")
            if len(wanted) <= len(parts) and all(w in ("*", p) for w, p in zip(wanted, parts[-len(wanted):])):
                return cls
    return Envoy


def served_collisions(module: torch.nn.Module) -> list:
    """Paths of submodules whose names an Envoy serves itself (BERT's `...output`)."""
    return [
        "model." + path
        for path, _ in module.named_modules()
        if path and path.rsplit(".", 1)[-1] in SERVED
    ]


def _repr_with_aliases(module, path, aliases, indent=""):
    """torch's module repr, with each child's aliases shown as `(alias/name)`."""
    here = aliases.get(path, {})
    direct = {}
    for alias, relative in here.items():
        if "." not in relative:
            direct.setdefault(relative, []).append(alias)
    lines = [line for line in module.extra_repr().split("\n") if line]
    for name, child in module._modules.items():
        if child is None:
            continue
        label = "/".join([*direct.get(name, []), name])
        child_repr = _repr_with_aliases(child, f"{path}.{name}", aliases, indent + "  ")
        lines.append(f"({label}): {child_repr}")
    for alias, relative in here.items():
        if "." in relative:
            lines.append(f"({alias}): -> {path}.{relative}")
    head = type(module).__name__ + "("
    if not lines:
        return head + ")"
    if len(lines) == 1 and not module._modules:
        return head + lines[0] + ")"
    inner = "\n".join(f"{indent}  {line}" for line in lines)
    return f"{head}\n{inner}\n{indent})"


class eproperty:
    """A value served during a trace, computed from one of the module's locations.

    nnsight 0.8's way to give an Envoy subclass its own readable, writable values:

        class Heads(interlace.Envoy):
            @interlace.eproperty(key="output")
            def heads(self, value):                  # what reading `.heads` returns
                b, s, h = value.shape
                return value.view(b, s, 4, h // 4)

            @heads.postprocess
            def heads(self, value):                  # what assigning `.heads = v` writes
                return value.flatten(-2)

    `key` is the location: `"output"` (default), `"input"` / `"inputs"` (the raw
    `(args, kwargs)`). In-place edits of a view returned by the getter reach the model when
    the view shares the module's storage (as `view`/slicing does).
    """

    def __init__(self, fn=None, *, key=None, description=None):
        self.key = key
        self.description = description
        self.name = None
        self._pre = None
        self._post = None
        if fn is not None:
            self(fn)

    def __call__(self, fn):
        self._pre = fn
        self.name = fn.__name__
        if self.key is None:
            self.key = fn.__name__ if fn.__name__ in ("output", "input", "inputs") else "output"
        if self.key not in ("output", "input", "inputs"):
            raise ValueError(f"eproperty key must be 'output', 'input' or 'inputs', not {self.key!r}")
        self.__doc__ = fn.__doc__
        return self

    def __set_name__(self, owner, name):
        self.name = name

    def postprocess(self, fn):
        """Decorate the function that turns an assigned value into the location's value."""
        self._post = fn
        return self

    def _location(self, envoy):
        return 2 * envoy._index + (1 if self.key == "output" else 0)

    def __get__(self, envoy, owner=None):
        if envoy is None:
            return self
        raw = envoy._interleaver(self.name).read(self._location(envoy))
        return self._pre(envoy, raw)

    def __set__(self, envoy, value):
        if self._post is not None:
            value = self._post(envoy, value)
        envoy._interleaver(self.name).write(self._location(envoy), value)

    def __repr__(self):
        return f"<eproperty {self.name} ({self.key}){': ' + self.description if self.description else ''}>"
