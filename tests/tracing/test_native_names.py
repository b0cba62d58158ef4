"""The compiled extension, its pure-Python twin and the checked-in `.pyi` stub agree on names.

`_native` swaps one module for the other behind the same names; a name one of them lacks
is an AttributeError on one path only. The twin and the stub are read as source (importing
the twin next to the live compiled module would install both frame mechanisms); the
compiled module is imported on the native path only.
"""

import ast
import importlib
import pathlib

import pytest

import interlace

PACKAGE = pathlib.Path(interlace.__file__).parent
PAIRS = [("_cframes", "_pyframes"), ("_chotpath", "_pyhotpath")]


def _top_level_names(path):
    """Names a module binds at top level, in either branch of a top-level if/try (the twin
    defines some per Python version)."""
    names = set()
    nodes = list(ast.parse(path.read_text()).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.If, ast.Try)):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                nodes.extend(handler.body)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("compiled, twin", PAIRS)
def test_the_twin_defines_what_the_stub_declares(compiled, twin):
    assert _top_level_names(PACKAGE / f"{twin}.py") == _top_level_names(PACKAGE / f"{compiled}.pyi")


@pytest.mark.native_only
@pytest.mark.parametrize("compiled, twin", PAIRS)
def test_the_compiled_module_exposes_what_the_stub_declares(compiled, twin):
    module = importlib.import_module(f"interlace.{compiled}")
    declared = _top_level_names(PACKAGE / f"{compiled}.pyi")
    missing = {name for name in declared if not hasattr(module, name)}
    assert not missing
    exposed = {
        name for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    }
    assert exposed <= declared, exposed - declared
