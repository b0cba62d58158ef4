"""The `with` statement as source: find it at a call site, check its shape, compile its body.

`blocks.capture` calls `build_block` on a miss (imported then: the parser and its modules
cost `import interlace` nothing); the result is a `block.Block`. The tracer's steps run here:
its `parse` finds the node, its `build` gives the statements the body runs, and
`function_module` wraps them in the body function that its `compile` compiles (the default
steps are `parse_source`/`parse`, `build_module` and `compile_module`).

Only the `with` statement itself is parsed (a slice of the file, from the `with` line to the
first line back at its indentation); the whole file is parsed only when the slice does not
parse (a triple-quoted string at column 0, a header continued below the `with`'s indentation).

The body is compiled under the user's filename, with the user's line numbers and the caller's
`co_name`, so tracebacks, coverage and debuggers see the user's lines. It becomes a function
whose parameters are the caller's names the body mentions (its locals; in a class body the
class namespace; at module level only the globals the body binds, so that the ones it only
reads stay live global lookups), called with their current values, i.e. against a copy of the
caller's locals; its globals are the caller's real globals. Nested scopes in the
body (comprehensions, generator expressions, lambdas, functions it defines) then see those
names as closure variables, exactly as inline (a plain `exec(code, globals, locals_copy)`
would hide them), and no module dict is copied per trace.
Which of those names are bound differs between calls (a local assigned later in the function),
so one function is compiled per set of bound names (usually one); an unbound name stays
unbound in the body and reading it raises `UnboundLocalError` naming it, as inline.

Shapes refused at capture (`UnsupportedBlockError`, naming file:line and what to write instead):
`return`, `yield`/`yield from`, `await`/`async for`/`async with`/async comprehensions directly
in the body, and `break`/`continue` that would leave the body (those inside a loop within the
body are fine). The body never runs in the caller's frame, so none of these could mean what
they mean inline; refusing them up front means a body is never run twice or half-run.

`global x` in the body is kept: the body's writes to `x` go to the module globals at once, as
inline (the caller's function has `x` global too, the declaration being function-wide; at
module level `x` is a global anyway). `global x` in the caller's function (or class body)
outside the `with` is scope-wide as well: a name the body binds that the caller declares
global (`_caller_globals`, read from the caller's bytecode) is declared `global` in the body
too, so the body reads and writes the module global at once, as inline. (At module level a
`global` statement outside the body is a no-op, for Python and here.)
`nonlocal x` in the body is dropped: the caller's function already declares `x` free (the
declaration is function-wide), so in the body `x` is an ordinary caller local, read from the
caller's cell and, if saved (or in a nested trace), written back to that cell.

Known limits: zero-argument `super()` and private-name mangling (`self.__x` in a method) do
not work inside a body, since the body is compiled outside the class.
"""

from __future__ import annotations

import __future__
import ast
import dis
import re
import types

from .. import versions
from ..errors import UnsupportedBlockError, WithBlockNotFoundError
from . import skip, source
from .block import LOCALS_PARAM, SYNTHETIC, Block, Recent

# Opcodes that call __enter__/__aenter__ for one with item (3.10: SETUP_WITH; 3.11+:
# BEFORE_WITH; both: BEFORE_ASYNC_WITH). 3.10's SETUP_ASYNC_WITH comes after the awaited
# __aenter__ and calls nothing.
WITH_OPCODES = frozenset(dis.opmap[name] for name in versions.WITH_ENTER_OPS if name in dis.opmap and name != "SETUP_ASYNC_WITH")
_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]
_WITH_NODES = (ast.With, ast.AsyncWith)

_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag
_WITH_LINE = re.compile(r"[ \t\f]*(?:async[ \t]+)?with\b")
_WITH_LINE_LOOKBACK = 200  # lines searched upwards for the `with` of a multi-line header
_FUNCTION_FIELDS = ast.FunctionDef._fields
_GLOBAL_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})
_COMPREHENSION_NAMES = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})  # 3.10/3.11 code objects


class CallSite:
    """Where a tracer was entered: file, line, column (3.11+) and which `with` item."""

    __slots__ = ("filename", "lineno", "col", "position", "co_name", "lasti")

    def __init__(self, filename, lineno, col, position, co_name, lasti):
        self.filename = filename
        self.lineno = lineno  # f_lineno at __enter__: the `with` line (3.13: the item's line)
        self.col = col  # column of that position (3.11+), None on 3.10
        self.position = position  # the co_positions() entry of the with opcode, or None
        self.co_name = co_name
        self.lasti = lasti

    def __repr__(self):
        return f"CallSite({self.filename}:{self.lineno}, col={self.col})"


# -- locating the site ---------------------------------------------------------------------
def enter_offset(code, lasti):
    """Byte offset of the with-enter opcode at `lasti` (3.10's f_lasti may point at the
    EXTENDED_ARG before it, when the with's handler is far away)."""
    raw = code.co_code
    while lasti + 2 < len(raw) and raw[lasti] == _EXTENDED_ARG:
        lasti += 2
    return lasti


def site_of(frame) -> CallSite:
    code = frame.f_code
    lasti = enter_offset(code, frame.f_lasti)
    position = None
    col = None
    positions = getattr(code, "co_positions", None)
    if positions is not None:
        for index, entry in enumerate(positions()):
            if index == lasti // 2:
                position = entry
                col = entry[2]
                break
    lineno = position[0] if position is not None and position[0] is not None else frame.f_lineno
    return CallSite(code.co_filename, lineno, col, position, code.co_name, lasti)


def _item_index_from_bytecode(code, lasti, site):
    """Which item of a multi-item `with` this is, when positions name only the statement.

    Counts the with-opcodes before `lasti` that share the site's position (3.11/3.12) or line
    (3.10): the items of one `with` are entered in order, and no other `with` shares them.
    """
    raw = code.co_code
    if site.position is not None:
        positions = list(code.co_positions())
        return sum(1 for off in range(0, lasti, 2) if raw[off] in WITH_OPCODES and positions[off // 2] == site.position)
    lines = {}
    for start, end, line in code.co_lines():
        for off in range(start, end, 2):
            lines[off] = line
    return sum(1 for off in range(0, lasti, 2) if raw[off] in WITH_OPCODES and lines.get(off) == site.lineno)


def parse(lines, site):
    """The `ast.With` node for the site: slice-parse the statement, whole file as fallback."""
    start = _with_start(lines, site.lineno)
    if start is not None:
        try:
            tree = _parse_slice(lines, start)
        except SyntaxError:
            tree = None
        if tree is not None:
            node = _find_with(tree, site.lineno, site.col, site.position)
            if node is not None:
                return node
    tree = _whole_file(site.filename, lines)
    return None if tree is None else _find_with(tree, site.lineno, site.col, site.position)


def parse_source(source, lineno):
    """`Tracer.parse`'s default: the `with`/`async with` node starting on `lineno` of `source`
    (or one of whose items starts there: 3.12+ enter an item from its own line), or None.

    Line numbers are the file's. Only the statement is parsed (a slice from its `with` line);
    the whole text only when the slice does not parse."""
    lines = source.splitlines(keepends=True)
    if not 1 <= lineno <= len(lines):
        return None
    start = _with_start(lines, lineno)
    if start is not None:
        try:
            node = _with_on_line(_parse_slice(lines, start), lineno)
        except SyntaxError:
            node = None
        if node is not None:
            return node
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    return _with_on_line(tree, lineno)


def _with_on_line(tree, lineno):
    """The With node starting on `lineno`, else the one with an item starting there."""
    withs = [node for node in ast.walk(tree) if type(node) in _WITH_NODES]
    for node in withs:
        if node.lineno == lineno:
            return node
    for node in withs:
        if any(item.context_expr.lineno == lineno for item in node.items):
            return node
    return None


def with_line(lines, lineno):
    """The line the `with` keyword of the statement entered at `lineno` is on."""
    return _with_start(lines, lineno) or lineno


# filename -> whole-file AST (the fallback only), or None if it does not parse; a few files.
_TREES: dict = Recent(4)


def _whole_file(filename, lines):
    try:
        return _TREES[filename]
    except KeyError:
        pass
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        tree = None
    _TREES[filename] = tree
    return tree


def _with_start(lines, lineno):
    """The line number of the `with` keyword at or above `lineno` (multi-line headers)."""
    for number in range(lineno, max(0, lineno - _WITH_LINE_LOOKBACK), -1):
        if number <= len(lines) and _WITH_LINE.match(lines[number - 1]):
            return number
    return None


def _indent(line):
    return len(line) - len(line.lstrip(" \t\f"))


def _parse_slice(lines, start):
    """Parse the lines of the statement starting at `start` (1-based), keeping positions."""
    first = lines[start - 1]
    base = _indent(first)
    end = start
    for end in range(start, len(lines)):
        line = lines[end]  # 0-based index `end` is line end + 1
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if _indent(line) <= base and stripped[0] not in ")]}":
            break
    else:
        end = len(lines)
    text = "".join(lines[start - 1 : end])
    if base:
        # Keep the columns exact: nest the indented slice under `if 1:` and shift lines.
        tree = ast.parse("if 1:\n" + text)
        tree = ast.Module(body=tree.body[0].body, type_ignores=[])
        ast.increment_lineno(tree, start - 2)
    else:
        tree = ast.parse(text)
        ast.increment_lineno(tree, start - 1)
    return tree


def _find_with(tree, lineno, col, position):
    """The With node the site points at.

    3.10: the `with` line. 3.11/3.12: the whole statement's (line, col). 3.13: the item's
    context expression (line, col).
    """
    for node in ast.walk(tree):
        if type(node) not in _WITH_NODES:
            continue
        if col is None:
            if node.lineno == lineno:
                return node
        elif node.lineno == lineno and node.col_offset == col and position[1] == node.end_lineno:
            return node
        else:
            for item in node.items:
                expr = item.context_expr
                if expr.lineno == lineno and expr.col_offset == col:
                    return node
    return None


def _synthetic_item(code, lasti):
    """(source With node, item index) when `code` is a compiled body that enters the later
    items of a multi-item `with` and `lasti` is one of them; else None."""
    entry = SYNTHETIC.get(id(code))
    if entry is None or entry[0]() is not code:
        return None
    node, base = entry[1], entry[2]
    raw = code.co_code
    enters = [off for off in range(0, len(raw), 2) if raw[off] in WITH_OPCODES]
    position = enters.index(lasti) if lasti in enters else len(node.items)
    return (node, base + position) if base + position < len(node.items) else None


def _item_index(node, site, code):
    if len(node.items) == 1:
        return 0
    if site.col is not None:
        for index, item in enumerate(node.items):
            expr = item.context_expr
            if expr.lineno == site.lineno and expr.col_offset == site.col:
                return index  # 3.13: the position is the item's own
    # A `finally` body is compiled twice (3.10/3.11): each copy enters all items in order.
    return _item_index_from_bytecode(code, site.lasti, site) % len(node.items)


def _body_statements(node, item_index, body=None):
    """The statements after the tracer's item: `body` (default: the source's), or
    `with <later items>: body` when the tracer is not the last item."""
    body = node.body if body is None else body
    if item_index == len(node.items) - 1:
        return list(body)
    rest = node.items[item_index + 1 :]
    first = rest[0].context_expr
    inner = ast.With(items=rest, body=body, type_comment=None)
    inner.lineno, inner.col_offset = first.lineno, first.col_offset
    inner.end_lineno, inner.end_col_offset = node.end_lineno, node.end_col_offset
    return [inner]


def body_statements(node, item_index, steps):
    """What the body function runs: the statements of the tracer's `build` step, entered
    into the later items of the `with` when the tracer is not its last item."""
    return _body_statements(node, item_index, steps._built_body(node))


def rebuild_statements(block, steps):
    """A Block rebuilt from a pickle keeps its source, not its AST: parse its own slice again
    (the tracer's `parse` step) and set its `node` and `statements`."""
    lines = ("\n",) * (block.first_line - 1) + tuple(block.source_lines)
    node = steps._parse_source("".join(lines), block.lineno)
    if node is None:
        raise WithBlockNotFoundError(f"{block.filename}:{block.lineno}: cannot rebuild the pickled block")
    block.node = node
    statements = body_statements(node, block.item_index, steps)
    block.statements = _scope_declarations(statements, block.kind)[0]


# -- building the Block ---------------------------------------------------------------------
def build_block(frame, steps):
    code = frame.f_code
    lasti = enter_offset(code, frame.f_lasti)
    filename = code.co_filename
    if code.co_code[lasti] not in WITH_OPCODES:
        raise WithBlockNotFoundError(
            f"{filename}:{frame.f_lineno}: a tracer was entered but not used as a with block "
            f"(in {code.co_name}(), the tracer's __enter__ was called directly or through a helper "
            f"such as contextlib.ExitStack). Write `with <tracer>:` at the call site."
        )
    site = site_of(frame)
    lines = source.lines(filename, frame.f_globals)
    if lines is None:
        raise WithBlockNotFoundError(
            f"{filename}:{site.lineno}: the source of this with block could not be read (stdin, "
            f"exec of a string, a file edited since it was first read). interlace runs the block "
            f"from its source: put the code in a file, a notebook cell or `python -c`."
        )
    synthetic = _synthetic_item(code, lasti)
    node = synthetic[0] if synthetic is not None else steps._parse_site(lines, site)
    if node is None:
        raise WithBlockNotFoundError(
            f"{filename}:{site.lineno}: no with statement found at this line of the source; the "
            f"file may have changed since it was first read (interlace reads each source once). "
            f"Restart the process after editing the file."
        )
    item_index = synthetic[1] if synthetic is not None else _item_index(node, site, code)
    if type(node) is ast.AsyncWith and item_index < len(node.items) - 1:
        raise UnsupportedBlockError(
            f"{filename}:{node.lineno}: the tracer is not the last item of this `async with` (in "
            f"{code.co_name}()): its body would have to enter the later items with `async with`, "
            f"which cannot run outside the coroutine. Put the tracer last (`async with other, "
            f"tracer:`), or enter the other items in an enclosing `async with`."
        )
    # What the skip jumps over is the source's body; what runs is the `build` step's.
    first = _body_statements(node, item_index)[0]
    passonly = item_index == len(node.items) - 1 and all(_is_inert(stmt) for stmt in node.body)
    statements = body_statements(node, item_index, steps)
    _refuse_escapes(statements, filename, node.lineno, code.co_name)
    kind = _kind(frame)
    statements, declared_global, declared_nonlocal = _scope_declarations(statements, kind)
    bound_names = _bound_names(statements)
    declared_global |= _caller_globals(code, kind, bound_names)
    assigned = (bound_names - declared_global) | declared_nonlocal
    if kind == "module":
        # Names the body only reads stay global lookups (live, like inline); names it binds
        # start from the global's current value, then stay the body's own (a copy).
        names = tuple(sorted(assigned))
    else:
        names = {n.id for stmt in statements for n in ast.walk(stmt) if type(n) is ast.Name}
        names = tuple(sorted((names | assigned | declared_nonlocal) - declared_global))
    start = _with_start(lines, node.lineno) or node.lineno
    block = Block(
        filename=filename,
        lineno=node.lineno,
        end_lineno=node.end_lineno,
        first_body_line=first.lineno,
        same_line=_on_header_line(lines, first),
        first_is_try=type(first) is ast.Try or type(first).__name__ == "TryStar",
        assigned_names=frozenset(assigned),
        names=names,
        declared_global=frozenset(declared_global),
        item_index=item_index,
        n_items=len(node.items),
        passonly=passonly,
        co_name=code.co_name,
        co_qualname=getattr(code, "co_qualname", code.co_name),
        kind=kind,
        caller_locals=frozenset(code.co_varnames + code.co_cellvars + code.co_freevars).intersection(names)
        if kind == "function"
        else frozenset(),
        flags=code.co_flags & _FUTURE_FLAGS,
        node=node,
        statements=statements,
        source_lines=tuple(lines[start - 1 : node.end_lineno]),
        first_line=start,
    )
    # Compile now, for the names bound at this moment plus the `as` targets, so that a body
    # that does not compile fails at capture; other sets of bound names compile on demand.
    try:
        bound = frame.f_locals
        targets = {n.id for item in node.items if item.optional_vars for n in ast.walk(item.optional_vars) if type(n) is ast.Name}
        params = tuple(n for n in names if n in bound or n in targets)
        skip.release_locals(frame, bound)  # the snapshot would keep the caller's locals alive
        block.function_code(params, steps, frame=frame)
    except SyntaxError as error:
        raise UnsupportedBlockError(
            f"{filename}:{error.lineno or node.lineno}: the traced block at line {node.lineno} does "
            f"not compile on its own ({error.msg}); move that statement out of the with block."
        ) from None
    return block


def _kind(frame):
    if frame.f_code.co_flags & versions.CO_OPTIMIZED:
        return "function"
    if frame.f_locals is frame.f_globals:
        return "module"
    return "class"


def _is_inert(stmt):
    return type(stmt) is ast.Pass or (type(stmt) is ast.Expr and type(stmt.value) is ast.Constant)


def _on_header_line(lines, stmt):
    line = lines[stmt.lineno - 1].encode("utf-8")[: stmt.col_offset]
    return bool(line.strip())


# -- shape checks ------------------------------------------------------------------------
_ESCAPE_ADVICE = {
    "return": "the body runs later, outside {co}()'s frame, so it cannot return from it. Save the "
    "value inside the block (`result = value.save()`) and `return result` after the with block",
    "yield": "the body runs later, outside {co}()'s frame, so it cannot yield from it. Collect the "
    "values in a list, `.save()` it, and yield them after the with block",
    "await": "the body runs synchronously, outside the coroutine. Await what you need before the "
    "with block, or await a saved value after it",
    "break": "it would leave the block for the caller's loop, which the body does not run in. Save a "
    "flag inside the block (`stop = save(True)`) and `break` after the with block",
}
_ESCAPE_ADVICE["continue"] = _ESCAPE_ADVICE["break"].replace("`break`", "`continue`")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_LOOPS = (ast.For, ast.While, ast.AsyncFor)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


_ADVICE_OF_SHAPE = {
    "return": "return", "yield": "yield", "yield from": "yield", "await": "await",
    "async for": "await", "async with": "await", "break": "break", "continue": "continue",
}  # fmt: skip


def _refuse_escapes(statements, filename, lineno, co_name):
    for stmt in statements:
        for node, shape in _escapes(stmt, False):
            advice = _ESCAPE_ADVICE[_ADVICE_OF_SHAPE[shape]].format(co=co_name)
            raise UnsupportedBlockError(
                f"{filename}:{node.lineno}: `{shape}` inside the traced block at line {lineno} "
                f"(in {co_name}()) cannot be traced: {advice}."
            )


def _escapes(node, in_loop):
    """(node, shape) for each statement/expression that would escape the body."""
    kind = type(node)
    if kind is ast.Return:
        yield node, "return"
    elif kind is ast.Yield:
        yield node, "yield"
    elif kind is ast.YieldFrom:
        yield node, "yield from"
    elif kind is ast.Await:
        yield node, "await"
    elif kind is ast.AsyncFor:
        yield node, "async for"
    elif kind is ast.AsyncWith:
        yield node, "async with"
    elif kind in (ast.Break, ast.Continue) and not in_loop:
        yield node, "break" if kind is ast.Break else "continue"
    elif kind is ast.comprehension and node.is_async:
        yield node.iter, "async for"
    if kind in _SCOPES:
        # Only what the enclosing scope evaluates: decorators, defaults, bases.
        parts = list(getattr(node, "decorator_list", ()))
        if kind is ast.ClassDef:
            parts += node.bases + [k.value for k in node.keywords]
        else:
            parts += [d for d in node.args.defaults + node.args.kw_defaults if d is not None]
        for part in parts:
            yield from _escapes(part, in_loop)
        return
    if kind in _LOOPS:
        head = [node.test] if kind is ast.While else [node.target, node.iter]
        for part in head + node.orelse:
            yield from _escapes(part, in_loop)
        for part in node.body:
            yield from _escapes(part, True)
        return
    for child in ast.iter_child_nodes(node):
        yield from _escapes(child, in_loop)


# -- scope facts -----------------------------------------------------------------------------
def _scope_declarations(statements, kind):
    """Drop body-level `nonlocal`; collect body-level `global` and `nonlocal` names."""
    declared_global, declared_nonlocal = set(), set()

    def visit(stmts):
        kept = []
        for stmt in stmts:
            kind_ = type(stmt)
            if kind_ is ast.Global:
                declared_global.update(stmt.names)
            elif kind_ is ast.Nonlocal:
                declared_nonlocal.update(stmt.names)
                stmt = ast.copy_location(ast.Pass(), stmt)
            elif not isinstance(stmt, _SCOPES):
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    inner = getattr(stmt, field, None)
                    if inner:
                        if field in ("handlers", "cases"):
                            for sub in inner:
                                sub.body = visit(sub.body)
                        else:
                            setattr(stmt, field, visit(inner))
            kept.append(stmt)
        return kept

    if any(type(n) in (ast.Global, ast.Nonlocal) for stmt in statements for n in ast.walk(stmt)):
        import copy

        statements = visit(copy.deepcopy(statements))
    return statements, declared_global, declared_nonlocal


def _caller_globals(code, kind, bound):
    """The names in `bound` (those the body binds) that the caller's function or class body
    declares `global`: the declaration is scope-wide, so the body's bindings of them are
    module-global writes, as inline, wherever the `global` statement stands.

    The body's code is part of the caller's, where a declared global is bound by STORE_GLOBAL
    or DELETE_GLOBAL; a walrus in a comprehension binds in the function too, from the
    comprehension's own code object on 3.10/3.11 (searched as well; no other nested code is
    the caller's scope). The caller's local names are no guide: 3.12+ lists a global that an
    inlined comprehension's walrus binds among them. A name bound under private-name mangling
    (`__x` in a method) is stored under its mangled name, so it is never taken for a global.
    At module level `global` is a no-op, and so it stays here (the module rule holds: the body
    binds a copy, written back when saved); nor could it be read there, as 3.12+ stores a
    comprehension's walrus target with STORE_GLOBAL, declared or not.
    """
    if kind == "module":
        return set()
    found = set()
    todo = [code]
    while todo:
        current = todo.pop()
        found.update(ins.argval for ins in dis.get_instructions(current) if ins.opname in _GLOBAL_STORES)
        if kind == "function":
            todo.extend(c for c in current.co_consts if type(c) is types.CodeType and c.co_name in _COMPREHENSION_NAMES)
    return found & bound


def _bound_names(statements):
    """Names the statements bind in their own scope (not inside nested defs/lambdas/classes)."""
    bound = set()

    def visit(node, in_comprehension):
        kind = type(node)
        if kind is ast.Name:
            if type(node.ctx) is not ast.Load and not in_comprehension:
                bound.add(node.id)
            return
        if kind is ast.NamedExpr:
            bound.add(node.target.id)  # walrus binds in the enclosing scope, even in a comprehension
            visit(node.value, in_comprehension)
            return
        if kind in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
            if not in_comprehension:
                bound.add(node.name)
            parts = list(node.decorator_list)
            parts += node.bases + [k.value for k in node.keywords] if kind is ast.ClassDef else [
                d for d in node.args.defaults + node.args.kw_defaults if d is not None]
            for part in parts:
                visit(part, in_comprehension)
            return
        if kind is ast.Lambda:
            for part in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
                visit(part, in_comprehension)
            return
        if kind in (ast.Import, ast.ImportFrom):
            for alias in node.names:
                if alias.name != "*":
                    bound.add(alias.asname or alias.name.split(".")[0])
            return
        if kind is ast.ExceptHandler and node.name:
            bound.add(node.name)
        elif kind in (ast.MatchAs, ast.MatchStar) and node.name:
            bound.add(node.name)
        elif kind is ast.MatchMapping and node.rest:
            bound.add(node.rest)
        if kind in _COMPREHENSIONS:
            in_comprehension = True
        for child in ast.iter_child_nodes(node):
            visit(child, in_comprehension)

    for stmt in statements:
        visit(stmt, False)
    return bound


# -- the body function, and the default build / compile steps ------------------------------
def build_module(node):
    """`Tracer.build`'s default: the block's body statements as a module, locations filled."""
    return ast.fix_missing_locations(ast.Module(body=list(node.body), type_ignores=[]))


def compile_module(module, frame):
    """`Tracer.compile`'s default: compile under the frame's filename and future flags, named
    after the frame's function (`co_name`, and `co_qualname` on 3.11+)."""
    code = frame.f_code
    compiled = compile(module, code.co_filename, "exec", flags=code.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    if hasattr(compiled, "co_qualname"):
        return compiled.replace(co_name=code.co_name, co_qualname=code.co_qualname)
    return compiled.replace(co_name=code.co_name)


def function_module(block, params):
    """The module the body function is compiled from: one function of `params` (the caller's
    names bound when the body runs) whose body is the block's statements, returning its locals."""
    statements = block.statements
    line = block.lineno
    loc = dict(lineno=line, col_offset=0, end_lineno=line, end_col_offset=0)
    returns = ast.Return(value=ast.Call(func=ast.Name(id=LOCALS_PARAM, ctx=ast.Load(), **loc), args=[], keywords=[], **loc), **loc)
    arguments = ast.arguments(
        posonlyargs=[],
        args=[ast.arg(arg=name, annotation=None, **loc) for name in params] + [ast.arg(arg=LOCALS_PARAM, annotation=None, **loc)],
        vararg=None,
        kwonlyargs=[],
        kw_defaults=[],
        kwarg=None,
        defaults=[],
    )
    body = list(statements) + [returns]
    if block.declared_global:
        # The body's own `global` statements are in it already; the caller's are not (they
        # stand outside the `with`). Declared first, as the caller's scope-wide ones act.
        body.insert(0, ast.Global(names=sorted(block.declared_global), **loc))
    unbound = [name for name in block.names if name in block.caller_locals and name not in params]
    if unbound:
        # The caller's locals that are unbound right now must stay *locals* of the body, so
        # that reading one raises UnboundLocalError naming it, as inline (a missing parameter
        # would be looked up as a global instead). Dead code: only the symbol table sees it.
        targets = [ast.Name(id=name, ctx=ast.Store(), **loc) for name in unbound]
        store = ast.Assign(targets=targets, value=ast.Constant(value=None, **loc), type_comment=None, **loc)
        body.append(ast.If(test=ast.Constant(value=0, **loc), body=[store], orelse=[], **loc))
    fields = dict(name=block.co_name, args=arguments, body=body, decorator_list=[], returns=None, type_comment=None)
    if "type_params" in _FUNCTION_FIELDS:
        fields["type_params"] = []
    function = ast.FunctionDef(**fields, **loc)
    # (a `build` step's statements may lack locations: they get the with line's)
    return ast.fix_missing_locations(ast.Module(body=[function], type_ignores=[]))


def globalize_reads(tree, block):
    """`build`'s module with the caller's unbound locals the body only reads made global
    lookups: drop them from the dead store that keeps them local (names the body assigns stay
    in it). A tree of another shape (a subclass's own build) is returned as it is."""
    function = tree.body[0] if tree.body and type(tree.body[0]) is ast.FunctionDef else None
    last = function.body[-1] if function is not None and function.body else None
    if (type(last) is ast.If and type(last.test) is ast.Constant and last.test.value == 0
            and len(last.body) == 1 and type(last.body[0]) is ast.Assign):
        store = last.body[0]
        store.targets = [t for t in store.targets if t.id in block.assigned_names]
        if not store.targets:
            function.body.pop()
    return tree


def function_of(code, block):
    """The body function's code in `code`, a module compiled from `function_module`'s tree,
    carrying the module code's name and filename (what the `compile` step set)."""
    function = next((c for c in code.co_consts if type(c) is types.CodeType), None)
    if function is None:
        raise TypeError(
            f"{block.filename}:{block.lineno}: the tracer's compile step returned code without the "
            f"body function in it; return the code that `super().compile(module, frame)` makes for "
            f"the module it is given (changed as you need)"
        )
    if hasattr(code, "co_qualname"):
        function = function.replace(co_name=code.co_name, co_qualname=code.co_qualname)
    else:
        function = function.replace(co_name=code.co_name)
    return _with_filename(function, code.co_filename)


def _with_filename(code, filename):
    if code.co_filename == filename:
        return code
    consts = tuple(_with_filename(c, filename) if type(c) is types.CodeType else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def compile_tree(block, tree):
    """The old shape of the compile step (`compile(block, tree)`): the body function's code."""
    return function_of(compile_module(tree, block.stand_in_frame()), block)
