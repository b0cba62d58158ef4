"""Module aliases: `Model(module, rename={...})` gives submodules extra names.

One analysis script then runs across architectures (`model.layers` on GPT-2 and on Llama).
A key names modules *relative to every envoy of the tree*, as nnsight 0.8 resolves them, and
its alias is bound on the envoy the key was resolved from:

- a dotted path, `"transformer.h"`: binds `layers` on the root only (the one envoy from which
  that path exists); a one-part path, `"attn"`, binds on every envoy that has an `attn` child;
- a path with wildcards: a `*` part is any one child (`"*.h"`), a part containing `*` is a
  glob over child names (`".*attn"` is `*attn`: `attn`, `self_attn`); a wildcard key that
  matches several modules from one envoy binds nothing there (an alias names one module);
- a module class: binds on every envoy with exactly one direct child of that class.

A leading `.` is ignored. Aliases resolve to the *same* envoy as the real path, so reading
through an alias binds to the same activation. The table is computed once, when the model is
wrapped, and kept as plain strings (no envoys: no reference cycle through it). An alias that
would hide a submodule, an envoy attribute or an attribute of the module is a `ValueError`:
the original would become unreachable by that name.
"""

from __future__ import annotations

import fnmatch

import torch


def plan(root: torch.nn.Module, rename, reserved) -> dict:
    """{envoy path: {alias: path relative to that envoy}} for `rename` over `root`'s tree.

    `reserved` is the set of names an envoy serves itself (`output`, `trace`, ...).
    """
    if not rename:
        return {}
    if not isinstance(rename, dict):
        raise TypeError(
            f"rename= takes a dict {{module path, pattern or class: alias or [aliases]}}, "
            f"got {type(rename).__name__}"
        )
    table: dict = {}
    for name, module in root.named_modules():
        host_path = "model." + name if name else "model"
        for key, aliases in rename.items():
            matches = _resolve(module, key)
            if len(matches) != 1:
                if len(matches) > 1 and isinstance(key, type):
                    raise ValueError(
                        f"rename key {key.__name__} matches {len(matches)} children of "
                        f"{host_path} ({', '.join(matches)}); an alias names one module: key "
                        f"those by name"
                    )
                continue
            (relative,) = matches
            for alias in [aliases] if isinstance(aliases, str) else list(aliases):
                _check(module, host_path, alias, relative, table.get(host_path, {}), reserved)
                table.setdefault(host_path, {})[alias] = relative
    return table


def _resolve(module, key) -> list:
    """The paths (relative to `module`) that `key` names from it."""
    if isinstance(key, type):
        return [n for n, m in module._modules.items() if m is not None and isinstance(m, key)]
    if not isinstance(key, str) or not key.strip("."):
        raise TypeError(f"a rename key is a module path, a pattern or a module class, not {key!r}")
    found = [("", module)]
    for part in key.lstrip(".").split("."):
        step = []
        for path, here in found:
            children = [(n, m) for n, m in here._modules.items() if m is not None]
            if "*" in part:
                step += [(f"{path}.{n}", m) for n, m in children if fnmatch.fnmatchcase(n, part)]
            else:
                step += [(f"{path}.{n}", m) for n, m in children if n == part]
        found = step
    unique = {}
    for path, found_module in found:  # one module reached twice is one match
        unique.setdefault(id(found_module), path[1:])
    return list(unique.values())


def _check(module, host_path, alias, relative, bound, reserved):
    if not isinstance(alias, str) or not alias.isidentifier():
        raise ValueError(f"rename alias {alias!r} for {relative!r} is not a valid attribute name")
    if alias == relative:
        return
    if alias in bound and bound[alias] != relative:
        displaced = f"the alias already bound there for {bound[alias]!r}"
    elif alias in module._modules:
        displaced = "a submodule of that name"
    elif alias in reserved:
        displaced = f"the envoy's own `.{alias}`"
    elif hasattr(module, alias):
        displaced = "an attribute of the module"
    else:
        return
    raise ValueError(
        f"rename alias {alias!r} for {relative!r} would hide {displaced} on {host_path}; "
        f"pick another alias"
    )
