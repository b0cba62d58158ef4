"""Round-trip real code: analyse every `with` site of some stdlib modules.

Every site must analyse without an error, and every site whose body can be traced (no
return/break/continue/yield/await inside) must get a verified normal exit, apart from
bodies that never fall through (all paths raise), where the skip raises instead.
"""

import ast
import dis
import importlib
import inspect

import pytest

from interlace.tracing import sites
from interlace import versions as V

MODULES = [
    "shutil", "tarfile", "zipfile", "traceback", "subprocess", "configparser", "trace",
    "tempfile", "threading", "logging", "concurrent.futures._base", "asyncio.locks",
    "multiprocessing.pool", "importlib._bootstrap_external", "http.cookiejar", "netrc",
]


class _Escapes(ast.NodeVisitor):
    """Does a with body contain a statement that leaves it (refused at capture)?"""

    def __init__(self):
        self.found = False

    def visit_FunctionDef(self, node):
        pass

    visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_FunctionDef

    def generic_visit(self, node):
        if isinstance(node, (ast.Return, ast.Break, ast.Continue, ast.Yield, ast.YieldFrom, ast.Await)):
            self.found = True
        super().generic_visit(node)


def _codes(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield from _codes(const)


def _raises_always(body):
    last = body[-1]
    return isinstance(last, ast.Raise)


@pytest.mark.parametrize("name", MODULES)
def test_every_with_site_of_a_stdlib_module_analyses(name):
    module = importlib.import_module(name)
    path = inspect.getsourcefile(module)
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    tree = ast.parse(source)
    traceable = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            visitor = _Escapes()
            for stmt in node.body:
                visitor.visit(stmt)
            traceable[node.lineno] = not visitor.found and not _raises_always(node.body)
    top = compile(source, path, "exec")
    for code in _codes(top):
        starts = list(dis.findlinestarts(code))
        for instr in dis.get_instructions(code):
            if instr.opname not in V.WITH_ENTER_OPS:
                continue
            site = sites.analyse(code, instr.offset)
            line = max((ln for off, ln in starts if off <= instr.offset and ln), default=None)
            with_line = max((ln for ln in traceable if line is not None and ln <= line), default=None)
            if with_line is not None and traceable[with_line]:
                assert site.exit_unit is not None, (path, with_line, code.co_name, site.refusal)
                assert site.body_start > site.with_unit
