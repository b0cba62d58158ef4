"""The layering `models -> intervention -> tracing -> _native` holds in the code, not only on paper.

Read from the source with `ast` (no import of interlace, torch-free, well under a second):

* imports: a package imports only the packages below it, even lazily inside a function
  (`models` may import `sweeps` inside a function: `model.sweep()` is the entry point);
  the compiled modules and their twins are imported only by `_native`, which chooses.
* cycles: no module of `src/` imports itself back through others, even lazily inside a
  function (a lazy import that dodges a cycle is still a cycle); `if TYPE_CHECKING:` imports
  do not count (they never run).
* private reaches: `X._name` (X not `self`/`cls`/`type(self)`/`super()`), `from ... import _name`
  and `getattr(X, "_name")` use a private name only where the package defines it (a def, a
  class, an assignment, `self._name = `, a `__slots__` entry, an import alias). A private
  name that interlace defines nowhere belongs to someone else (torch's `_forward_hooks`,
  `sys._getframe`) and is allowed.

Each violation is printed as `file:line: X._name (defined in pkg)`.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "interlace"

#: The package of each top-level module (subpackages are their own package).
TOP_LEVEL = {
    "__init__": "interlace",  # the public facade: may import everything, lazily
    "errors": "errors",
    "versions": "versions",
    "_native": "_native",
    "_pyframes": "_native",
    "_pyhotpath": "_native",
    "_cframes": "_native",
    "_chotpath": "_native",
}

#: What each package may import (besides itself). Lower layers never import upper ones.
_LEAVES = {"errors", "versions"}
ALLOWED = {
    "versions": set(),
    "errors": set(),
    "_native": {"versions"},
    "tracing": {"_native"} | _LEAVES,
    "intervention": {"tracing", "_native"} | _LEAVES,
    "models": {"intervention", "tracing", "_native"} | _LEAVES,
    "sweeps": {"models", "intervention", "tracing", "_native"} | _LEAVES,
    "interlace": {"tracing", "intervention", "models", "sweeps", "_native"} | _LEAVES,
}
#: Imports allowed only inside a function (an entry point of the upper package).
LAZY_ONLY = {("models", "sweeps")}
#: Modules only `_native` may import: everybody else asks `_native` which one is live.
CHOSEN_BY_NATIVE = {"interlace._pyframes", "interlace._pyhotpath", "interlace._cframes", "interlace._chotpath"}

_OWN_BASES = {"self", "cls"}
#: Underscore names that are documented public API elsewhere (namedtuple's methods).
PUBLIC_UNDERSCORE = {"_fields", "_field_defaults", "_asdict", "_replace", "_make"}
_ATTR_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder and name != "_" and name not in PUBLIC_UNDERSCORE


class Tree:
    """The modules of one `interlace` source tree, parsed (the real one, or a test's)."""

    def __init__(self, root: pathlib.Path = ROOT):
        self.root = root
        self.modules = [Module(self, path) for path in sorted(root.rglob("*.py"))]

    def package_of(self, dotted: str) -> str | None:
        """The layer package of an interlace module name, None outside interlace."""
        parts = dotted.split(".")
        if parts[0] != "interlace":
            return None
        if len(parts) == 1:
            return "interlace"
        if (self.root / parts[1]).is_dir():
            return parts[1]
        return TOP_LEVEL.get(parts[1], parts[1])

    def is_module(self, dotted: str) -> bool:
        parts = dotted.split(".")
        if parts[0] != "interlace":
            return False
        path = self.root.joinpath(*parts[1:])
        return path.is_dir() or any(path.with_suffix(ext).exists() for ext in (".py", ".pyi", ".pyx"))


class Module:
    """One parsed source file: its dotted name, package and tree."""

    def __init__(self, tree: Tree, path: pathlib.Path):
        parts = list(path.relative_to(tree.root.parent).with_suffix("").parts)
        self.is_package = parts[-1] == "__init__"
        self.name = ".".join(parts[:-1] if self.is_package else parts)
        self.package = tree.package_of(self.name)
        self.ast = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        self.rel = path.relative_to(tree.root.parent.parent).as_posix()

    def resolve(self, module: str | None, level: int) -> str:
        """The absolute name of a (possibly relative) `from` import's module."""
        if level == 0:
            return module or ""
        base = self.name.split(".")
        if not self.is_package:
            base = base[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))


# -- imports ------------------------------------------------------------------------------
def imports_of(tree: Tree, module: Module, type_checking: bool = True):
    """(line, imported interlace module, inside a function?) for each import in `module`;
    without the `if TYPE_CHECKING:` ones when `type_checking` is False."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            kind = type(child)
            if not type_checking and kind is ast.If and _is_type_checking(child.test):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), in_function)
                continue
            if kind is ast.Import:
                found.extend((child.lineno, alias.name, in_function) for alias in child.names)
            elif kind is ast.ImportFrom:
                base = module.resolve(child.module, child.level)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append((child.lineno, sub if tree.is_module(sub) else base, in_function))
            elif kind is ast.Call and _called_name(child) in ("import_module", "__import__") and child.args:
                arg = child.args[0]
                if type(arg) is ast.Constant and type(arg.value) is str:
                    found.append((child.lineno, arg.value, in_function))
            visit(child, in_function or kind in (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))

    visit(module.ast, False)
    return [(line, name, lazy) for line, name, lazy in found if name.split(".")[0] == "interlace"]


def _is_type_checking(test) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if type(func) is ast.Name else func.attr if type(func) is ast.Attribute else None


def import_violations(tree: Tree) -> list[str]:
    out = []
    for module in tree.modules:
        for line, name, lazy in imports_of(tree, module):
            target = tree.package_of(name)
            if name in CHOSEN_BY_NATIVE and module.package != "_native":
                out.append(f"{module.rel}:{line}: imports {name} directly (ask interlace._native)")
            elif target != module.package and target not in ALLOWED.get(module.package, ()):
                if lazy and (module.package, target) in LAZY_ONLY:
                    continue
                where = "inside a function" if lazy else "at import"
                out.append(f"{module.rel}:{line}: {module.package} imports {name} ({where}), a layer above it")
    return out


# -- cycles ---------------------------------------------------------------------------------
#: Cycles known and not yet removed (issue 17), each the set of modules it runs through. A
#: cycle not listed fails the test, and so does a listed one that is gone (drop it here).
KNOWN_CYCLES = []  # cycles still to break (none): each a set of module names


def import_graph(tree: Tree) -> dict[str, dict[str, list[int]]]:
    """module -> {module it imports: [lines]}, function-level imports included, the
    `if TYPE_CHECKING:` ones not; a package stands for its `__init__`."""
    names = {module.name for module in tree.modules}
    graph: dict[str, dict[str, list[int]]] = {}
    for module in tree.modules:
        edges = graph.setdefault(module.name, {})
        for line, name, _ in imports_of(tree, module, type_checking=False):
            lines = edges.setdefault(name, []) if name in names and name != module.name else None
            if lines is not None and line not in lines:
                lines.append(line)
    return graph


def import_cycles(tree: Tree) -> list[set[str]]:
    """The strongly connected components of the import graph with more than one module
    (Tarjan's algorithm, iterative)."""
    graph = import_graph(tree)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def describe_cycle(tree: Tree, component: set[str]) -> str:
    graph = import_graph(tree)
    rel = {module.name: module.rel for module in tree.modules}
    return "\n".join(
        f"  {rel[source]}:{line}: imports {target}"
        for source in sorted(component)
        for target, lines in sorted(graph[source].items())
        if target in component
        for line in lines
    )


# -- private names ------------------------------------------------------------------------
def definitions(tree: Tree) -> dict[str, set[str]]:
    """Private name -> the packages that define it."""
    defined: dict[str, set[str]] = {}

    def add(name, package):
        if is_private(name):
            defined.setdefault(name, set()).add(package)

    for module in tree.modules:
        package = module.package
        add(module.name.rsplit(".", 1)[-1], package)  # a module is a name of its package
        for node in ast.walk(module.ast):
            kind = type(node)
            if kind in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
                add(node.name, package)
            elif kind is ast.Name and type(node.ctx) is ast.Store:
                add(node.id, package)
            elif kind is ast.Attribute and type(node.ctx) is ast.Store and _own_base(node.value):
                add(node.attr, package)
            elif kind in (ast.Import, ast.ImportFrom):
                for alias in node.names:
                    add(alias.asname or alias.name.split(".")[0], package)
            elif kind is ast.Assign and any(type(t) is ast.Name and t.id == "__slots__" for t in node.targets):
                for const in ast.walk(node.value):
                    if type(const) is ast.Constant and type(const.value) is str:
                        add(const.value, package)
    return defined


def _own_base(node) -> bool:
    """`self`, `cls`, `type(self)`, `super()`: the object's own attributes."""
    if type(node) is ast.Name:
        return node.id in _OWN_BASES
    if type(node) is ast.Call and type(node.func) is ast.Name:
        if node.func.id == "super":
            return True
        if node.func.id == "type" and len(node.args) == 1:
            return _own_base(node.args[0])
    return False


def _imported(tree: Tree, module: Module) -> dict[str, str | None]:
    """Names bound by an import anywhere in `module` -> the interlace module they are, "" for
    a name imported from an interlace module, None for anything outside interlace."""
    bound = {}
    for node in ast.walk(module.ast):
        if type(node) is ast.Import:
            for alias in node.names:
                head = alias.name.split(".")[0]
                ours = alias.name if alias.asname else head
                bound[alias.asname or head] = ours if head == "interlace" else None
        elif type(node) is ast.ImportFrom:
            base = module.resolve(node.module, node.level)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                ours = sub if tree.is_module(sub) else ""
                bound[alias.asname or alias.name] = ours if base.split(".")[0] == "interlace" else None
    return bound


def _dotted(node) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while type(node) is ast.Attribute:
        parts.append(node.attr)
        node = node.value
    if type(node) is not ast.Name:
        return None
    return ".".join([node.id, *reversed(parts)])


def private_violations(tree: Tree) -> list[str]:
    defined = definitions(tree)
    out = []
    for module in tree.modules:
        imported = _imported(tree, module)

        def check(line, base, name, text):
            if not is_private(name) or _own_base(base):
                return
            dotted = _dotted(base)
            if dotted is not None and dotted.split(".")[0] in imported:
                root, _, rest = dotted.partition(".")
                target = imported[root]
                if target is None:
                    return  # an external module: `sys._getframe`, `torch.nn.Module._call_impl`
                if target:  # an interlace module (or a chain of them): that module's package
                    while rest and tree.is_module(f"{target}.{rest.split('.')[0]}"):
                        head, _, rest = rest.partition(".")
                        target = f"{target}.{head}"
                    owner = tree.package_of(target)
                    if owner != module.package:
                        out.append(f"{module.rel}:{line}: {text} (defined in {owner})")
                    return
            owners = defined.get(name, set())
            if owners and module.package not in owners:
                out.append(f"{module.rel}:{line}: {text} (defined in {', '.join(sorted(owners))})")

        for node in ast.walk(module.ast):
            kind = type(node)
            if kind is ast.Attribute:
                check(node.lineno, node.value, node.attr, f"{ast.unparse(node.value)}.{node.attr}")
            elif kind is ast.Call and type(node.func) is ast.Name and node.func.id in _ATTR_FUNCTIONS:
                args = node.args
                if len(args) >= 2 and type(args[1]) is ast.Constant and type(args[1].value) is str:
                    text = f"{node.func.id}({ast.unparse(args[0])}, {args[1].value!r})"
                    check(node.lineno, args[0], args[1].value, text)
            elif kind is ast.ImportFrom:
                base = module.resolve(node.module, node.level)
                owner = tree.package_of(base)
                for alias in node.names:
                    if not owner or owner == module.package or not is_private(alias.name):
                        continue
                    if tree.is_module(f"{base}.{alias.name}"):
                        continue  # a module (`from .. import _native`): the import rules judge it
                    out.append(f"{module.rel}:{node.lineno}: from {base} import {alias.name} (defined in {owner})")
    return sorted(set(out), key=_by_place)


def _by_place(line: str):
    path, number, _ = line.split(":", 2)
    return path, int(number)


# -- the real tree ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tree():
    return Tree()


def test_every_module_has_a_layer(tree):
    """A new top-level module or package must be placed in the tables (else its layer is a guess)."""
    top = {m.name.split(".")[1] for m in tree.modules if m.name.count(".") == 1 and not m.is_package}
    assert top <= set(TOP_LEVEL), f"give {sorted(top - set(TOP_LEVEL))} a package in TOP_LEVEL"
    packages = {m.package for m in tree.modules}
    assert packages <= set(ALLOWED), f"say what {sorted(packages - set(ALLOWED))} may import in ALLOWED"
    assert {"tracing", "intervention", "models", "sweeps"} <= packages


def test_no_package_imports_a_layer_above_it(tree):
    problems = import_violations(tree)
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_no_import_cycle(tree):
    cycles = import_cycles(tree)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles (break each with a leaf module, see intervention/access.py):\n" + \
        "\n\n".join(describe_cycle(tree, c) for c in new)
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"these known cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_no_private_reaches_across_packages(tree):
    problems = private_violations(tree)
    assert not problems, "private names used outside the package that defines them:\n" + "\n".join(problems)


# -- the checker itself, on small trees written for the purpose --------------------------------
def make_tree(tmp_path, files: dict[str, str]) -> Tree:
    root = tmp_path / "src" / "interlace"
    base = {"__init__.py": "", "errors.py": "", "versions.py": "", "_native.py": "",
            "tracing/__init__.py": "", "intervention/__init__.py": "", "models/__init__.py": "",
            "sweeps/__init__.py": ""}  # fmt: skip
    for rel, text in {**base, **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Tree(root)


def test_a_lazy_upward_import_is_caught(tmp_path):
    tree = make_tree(tmp_path, {
        "tracing/core.py": "from ..errors import InterlaceError\n"
                           "def f():\n    from ..intervention import engine\n",
        "intervention/engine.py": "import interlace.models\n",
        "models/model.py": "def sweep():\n    from ..sweeps import run\n",  # the allowed entry point
        "_native.py": "from . import _pyframes, versions\n",
        "_pyframes.py": "",
        "sweeps/run.py": "from .. import _pyframes\n",
    })  # fmt: skip
    assert import_violations(tree) == [
        "src/interlace/intervention/engine.py:1: intervention imports interlace.models (at import), a layer above it",
        "src/interlace/sweeps/run.py:1: imports interlace._pyframes directly (ask interlace._native)",
        "src/interlace/tracing/core.py:3: tracing imports interlace.intervention.engine (inside a function), a layer above it",
    ]


def test_an_import_cycle_is_caught_even_inside_a_function(tmp_path):
    tree = make_tree(tmp_path, {
        "intervention/envoy.py": "from . import leaf\n"
                                 "def traceable():\n    from .tracer import go\n",
        "intervention/tracer.py": "from .envoy import Envoy\n",
        "intervention/leaf.py": "from typing import TYPE_CHECKING\n"
                                "if TYPE_CHECKING:\n    from .envoy import Envoy\n"
                                "else:\n    from .. import errors\n",
    })  # fmt: skip
    cycles = import_cycles(tree)
    assert cycles == [{"interlace.intervention.envoy", "interlace.intervention.tracer"}]
    assert describe_cycle(tree, cycles[0]) == (
        "  src/interlace/intervention/envoy.py:3: imports interlace.intervention.tracer\n"
        "  src/interlace/intervention/tracer.py:1: imports interlace.intervention.envoy"
    )
    assert "interlace.errors" in import_graph(tree)["interlace.intervention.leaf"]


def test_a_private_reach_is_caught_and_foreign_privates_are_not(tmp_path):
    tree = make_tree(tmp_path, {
        "tracing/tracer.py": "import sys\n_getframe = sys._getframe\n"
                             "class Tracer:\n    __slots__ = ('_frame',)\n"
                             "    def go(self):\n        self._state = 1\n        return self._frame\n",
        "tracing/blocks.py": "_CACHE = {}\ndef _asdict(): pass\n",
        "intervention/run.py": "import sys\nimport torch\nfrom ..tracing import blocks\n"
                               "from ..tracing.tracer import _getframe\n"
                               "def f(tracer, module):\n"
                               "    tracer._frame = None\n"          # line 6: a reach (slot of tracing)
                               "    x = getattr(tracer, '_state')\n"  # line 7: a reach (self._state of tracing)
                               "    module._forward_hooks.clear()\n"  # torch's: defined nowhere here
                               "    sys._getframe(0)\n"               # an external module
                               "    torch.nn.Module._call_impl\n"     # an external module
                               "    point._asdict()\n"                # a namedtuple's public method
                               "    return blocks._CACHE\n",          # line 12: a module of tracing
        "intervention/own.py": "class E:\n    def __init__(self, other):\n"
                               "        self._peer = other\n        other._peer = self\n",  # its own package's name
    })  # fmt: skip
    assert private_violations(tree) == [
        "src/interlace/intervention/run.py:4: from interlace.tracing.tracer import _getframe (defined in tracing)",
        "src/interlace/intervention/run.py:6: tracer._frame (defined in tracing)",
        "src/interlace/intervention/run.py:7: getattr(tracer, '_state') (defined in tracing)",
        "src/interlace/intervention/run.py:12: blocks._CACHE (defined in tracing)",
    ]
