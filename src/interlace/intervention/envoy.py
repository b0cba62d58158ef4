"""The Envoy tree: a proxy per submodule, through which a trace body reads and edits values.

`model.transformer.h[0].mlp` walks the tree the way the module's attributes do; anything
that is not a submodule falls through to the module itself. An Envoy installs nothing on its
module: outside a trace the model is exactly the module the user gave us (no hooks, its own
`forward`), and inside a trace only the locations a body asks for get hooked.
"""

from __future__ import annotations

import torch

from ..errors import InterlaceError


class Envoy:
    """A submodule seen from a trace body: `.output`, `.input`, `.inputs`, `.skip()`."""

    def __init__(self, module: torch.nn.Module, path: str = "model", *, _root=None, _index=0):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_root", self if _root is None else _root)
        object.__setattr__(self, "_index", _index)
        object.__setattr__(self, "_children", {})

    # -- the tree ----------------------------------------------------------------------------

    def _child(self, name):
        child = self._children.get(name)
        if child is None:
            module = self._module._modules[name]
            root = self._root
            index = root._state_for_tree().index.get(id(module))
            child = Envoy(module, f"{self._path}.{name}", _root=root, _index=index)
            self._children[name] = child
        return child

    def __getattr__(self, name):
        # Only called when normal lookup fails: submodules first, then the module's attributes.
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

    def __getitem__(self, key):
        module = self._module
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
        return repr(self._module)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._module._modules) | set(dir(self._module)))

    # -- inside a trace ------------------------------------------------------------------------

    def _interleaver(self, what):
        # The running trace of this model, whatever thread runs it: the interleaver's own
        # check (is the caller its running body?) turns other threads away with a clear error.
        interleaver = self._root._state.active
        if interleaver is None:
            if self._root._state_for_tree().collecting:
                raise InterlaceError(
                    f"{self._path}.{what} was used outside an invoke: in a trace with "
                    f"`with tracer.invoke(...):` blocks, module values are read and edited "
                    f"inside the invoke blocks"
                )
            raise InterlaceError(
                f"{self._path}.{what} is only available inside a `with model.trace(...)` "
                f"block of this model"
            )
        return interleaver

    @property
    def output(self):
        """The module's output at the bound occurrence (a real value: the model waits)."""
        return self._interleaver("output").read(2 * self._index + 1)

    @output.setter
    def output(self, value):
        self._interleaver("output").write(2 * self._index + 1, value)

    @property
    def inputs(self):
        """`(args, kwargs)` the module is called with at the bound occurrence."""
        args, kwargs = self._interleaver("inputs").read(2 * self._index)
        return args, kwargs

    @inputs.setter
    def inputs(self, value):
        try:
            args, kwargs = value
            args, kwargs = tuple(args), dict(kwargs)
        except (TypeError, ValueError):
            raise TypeError(
                f"{self._path}.inputs must be assigned a pair (args, kwargs), got "
                f"{type(value).__name__}"
            ) from None
        self._interleaver("inputs").write(2 * self._index, (args, kwargs))

    @property
    def input(self):
        """The first positional argument, else the first keyword argument (Llama's layers)."""
        args, kwargs = self._interleaver("input").read(2 * self._index)
        if args:
            return args[0]
        if kwargs:
            return next(iter(kwargs.values()))
        raise InterlaceError(f"{self._path} was called without arguments: it has no .input")

    @input.setter
    def input(self, value):
        interleaver = self._interleaver("input")
        args, kwargs = interleaver.read(2 * self._index)
        if args:
            args = (value, *args[1:])
        elif kwargs:
            kwargs = dict(kwargs)
            kwargs[next(iter(kwargs))] = value
        else:
            raise InterlaceError(f"{self._path} was called without arguments: it has no .input")
        interleaver.write(2 * self._index, (args, kwargs))

    def skip(self, value):
        """The module does not run at the bound occurrence; `value` is its output instead."""
        self._interleaver("skip()").skip(self._index, value)

    def __call__(self, *args, **kwargs):
        """Run the module. Inside a trace body it runs as a plain module (no hooks fire)."""
        interleaver = self._root._active()
        if interleaver is not None and interleaver.current is not None:
            return interleaver.call_plain(self._module, args, kwargs)
        return self._module(*args, **kwargs)
