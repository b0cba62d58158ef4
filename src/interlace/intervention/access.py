"""How the features reach an Envoy: its module, path, index, engine and running trace, and
the `(args, kwargs)` pair its `.input`/`.inputs` read and write.

A leaf: it imports no feature and no Envoy (it reads the attributes an Envoy sets on
itself). `envoy.py` and every feature (`source.py`, `cache.py`, `edit.py`, `iteration.py`,
`tracer.py`, models, sweeps) import it; features that need the Envoy class import
`envoy.py`, and `envoy.py` never imports them back (`tests/test_layering.py`: no cycle).
"""

from __future__ import annotations

from ..errors import InterlaceError, NotInTraceError


def module_of(envoy):
    """The torch module `envoy` stands for (an Envoy's own attributes are its module's)."""
    return envoy.__dict__["_module"]


def engine_of(envoy):
    """The `Engine` of the model `envoy` belongs to (one per model, shared by its whole tree)."""
    return envoy.__dict__["_engine"]


def index_of(envoy):
    """The module's index in its model (its locations are `2 * index` and `2 * index + 1`);
    None for a module attached after wrapping."""
    return envoy.__dict__["_index"]


def active_interleaver(envoy):
    """The interleaver running a trace of `envoy`'s model in *this* thread, if any."""
    return envoy.__dict__["_engine"].active()


def running_interleaver(envoy, what):
    """The running trace of `envoy`'s model, whatever thread runs it, or the error that says
    why `<path>.<what>` cannot be used now (the interleaver's own check, is the caller its
    running body?, turns other threads away with a clear error)."""
    engine = envoy.__dict__["_engine"]
    interleaver = engine.running
    if interleaver is None:
        path = envoy.__dict__["_path"]
        if engine.collecting:
            raise InterlaceError(
                f"{path}.{what} was used outside an invoke: in a trace with "
                f"`with tracer.invoke(...):` blocks, module values are read and edited "
                f"inside the invoke blocks"
            )
        raise NotInTraceError(
            f"{path}.{what} is only available inside a `with model.trace(...)` "
            f"block of this model"
        )
    return interleaver


def first_input(inputs, path):
    """`.input` of `(args, kwargs)`: the first positional argument, else the first keyword one."""
    args, kwargs = inputs
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise InterlaceError(f"{path} was called without arguments: it has no .input")


def with_first_input(inputs, value, path):
    """`(args, kwargs)` with what `.input` reads replaced by `value`."""
    args, kwargs = inputs
    if args:
        return (value, *args[1:]), kwargs
    if kwargs:
        kwargs = dict(kwargs)
        kwargs[next(iter(kwargs))] = value
        return args, kwargs
    raise InterlaceError(f"{path} was called without arguments: it has no .input")


def as_inputs(value, path):
    """A value assigned to `<path>.inputs`, checked: the pair `(args tuple, kwargs dict)`."""
    try:
        args, kwargs = value
        return tuple(args), dict(kwargs)
    except (TypeError, ValueError):
        raise TypeError(
            f"{path}.inputs must be assigned a pair (args, kwargs), got {type(value).__name__}"
        ) from None
