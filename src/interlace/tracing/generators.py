"""Generator bodies: a captured body rewritten so that each read is a `yield`.

A body runs beside the model and waits for values (`.output`). On a greenlet a wait is a
switch of C stacks; a body compiled as a generator waits with a `yield`, and the model side
resumes it with `gen.send(value)`, with no second stack (what it costs and saves is measured
in docs/architecture.md, "Generator bodies"). A yield can only happen in the generator's own
frame, so a body takes this route only where capture proves that every read is there:

- `refusal(statements)` says why a body cannot be a generator, or None when it can: each
  read (an attribute load named in `READS`, a plain `x.output = value` store named in
  `WRITES`) is in the body's own scope, not in a lambda, a nested function or class, a
  generator expression, or a comprehension other than one `rewrite` makes a loop of the
  body's own (`_desugarable`); and the body uses nothing that waits in ways this route does not serve
  (`PINNED`: `tracer.iter`, barriers, `.grad`, `.skip()`, `stop()`, `.source`, ...), nor a
  `with` statement (invokes, `loss.backward()`, nested traces).
- `rewrite(module)`: the body function's module (`syntax.function_module`) with those
  comprehensions made loops, every read
  `x.output` replaced by `(yield from __interlace_read__(x, "output"))` and every
  `x.output = v` by `yield from __interlace_write__(v, x, "output")` (the value first, as
  Python evaluates an assignment), the two helpers being hidden parameters with defaults.
- `read(obj, name)` and `write(value, obj, name)`: those helpers. An object whose type has
  `__interlace_read__(name)` / `__interlace_write__(name, value)` (an Envoy, a tracer)
  serves the read with an iterator (a generator) that yields while it waits and returns
  the value; any other object is a plain `getattr` / `setattr`, with no yield.

What capture cannot see (a helper function the body calls that reads) is for the engine to
find out: it runs a site's first trace on a greenlet and audits where the reads came from,
and refuses, naming the line, a read that reaches a running generator body by another way.
Torch-free: the rewrite is tested on every supported Python.
"""

from __future__ import annotations

import ast  # (imported once a body is captured: `import interlace` loads no parser)
import copy

from .._native import frames
from .block import GENERATOR_PARAMS

READ_PARAM, WRITE_PARAM = HIDDEN = GENERATOR_PARAMS
"""The generator body function's hidden parameters, after the locals one (block.LOCALS_PARAM)."""

READS = frozenset({"output", "input", "inputs", "result"})
"""Attribute loads that may wait for the model: each becomes a yield point."""

WRITES = frozenset({"output", "input", "inputs"})
"""Attribute stores that may wait for the model (`x.output = value`)."""

PINNED = frozenset({
    "iter", "all", "next", "barrier", "grad", "backward", "skip", "stop", "source", "invoke",
})
"""Attributes whose use waits in ways the generator route does not serve: such a body keeps
its greenlet (a loop over `tracer.iter`, a barrier, gradients, skips, `stop()`, `.source`)."""



def refusal(statements) -> str | None:
    """Why the body made of `statements` must run on a greenlet, or None when every read it
    makes is in its own frame, or in a comprehension that `rewrite` turns into a loop of it
    (so that it can run as a generator)."""
    with_nodes = (ast.With, ast.AsyncWith)
    simple_stores = set()
    loops = set()  # comprehensions desugared into loops: their reads are the body's own
    for node in _walk(statements):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if type(target) is ast.Attribute and target.attr in WRITES:
                simple_stores.add(id(target))
        if isinstance(node, ast.stmt):
            comprehension = _desugarable(node)
            if comprehension is not None:
                loops.add(id(comprehension))
    for node, nested in _walk_scoped(statements, loops):
        if isinstance(node, with_nodes):
            return f"line {node.lineno}: a `with` statement in the body"
        if type(node) is not ast.Attribute:
            continue
        name = node.attr
        if name in PINNED:
            return f"line {node.lineno}: `.{name}` waits in a way only a greenlet body serves"
        if name not in READS and name not in WRITES:
            continue
        if nested:
            return (f"line {node.lineno}: `.{name}` inside a lambda, nested function or class, "
                    f"a generator expression, or a comprehension not made a loop (not the "
                    f"body's own frame)")
        if type(node.ctx) is not ast.Load and id(node) not in simple_stores:
            return f"line {node.lineno}: `.{name}` is assigned or deleted other than by `x.{name} = value`"
    return None


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp)


def _desugarable(statement):
    """The list, set or dict comprehension that `statement` can run as a loop of the body's
    own, or None. The statement must evaluate nothing that could have an effect before the
    comprehension: `name = [...]`, `[...]` alone, or a call of a name or dotted name with it
    as the only argument (`save([...])`, `interlace.save([...])`, alone or assigned to a name).
    The comprehension's targets must be names, with no `:=` and nothing async in it."""
    value = statement.value if type(statement) in (ast.Assign, ast.Expr) else None
    if type(statement) is ast.Assign and (len(statement.targets) != 1 or type(statement.targets[0]) is not ast.Name):
        return None
    if type(value) is ast.Call:
        if value.keywords or len(value.args) != 1 or not _dotted(value.func):
            return None
        value = value.args[0]
    if type(value) not in _COMPREHENSIONS:
        return None
    for generator in value.generators:
        if generator.is_async or not _names_only(generator.target):
            return None
    for node in ast.walk(value):
        if type(node) in (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom):
            return None
    return value


def _dotted(node):
    while type(node) is ast.Attribute:
        node = node.value
    return type(node) is ast.Name


def _names_only(target):
    if type(target) is ast.Name:
        return True
    return type(target) in (ast.Tuple, ast.List) and all(_names_only(t) for t in target.elts)


def _walk(statements):
    for statement in statements:
        yield from ast.walk(statement)


def _walk_scoped(statements, loops=()):
    """Every node under `statements` with whether it is inside a nested scope (comprehensions
    whose ids are in `loops` become loops of the enclosing scope: not nested)."""
    scopes = (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ListComp,
              ast.SetComp, ast.DictComp, ast.GeneratorExp)
    stack = [(statement, False) for statement in reversed(list(statements))]
    while stack:
        node, nested = stack.pop()
        yield node, nested
        inner = nested or (isinstance(node, scopes) and id(node) not in loops)
        children = list(ast.iter_child_nodes(node))
        for child in reversed(children):
            stack.append((child, inner))


class _Rewriter(ast.NodeTransformer):
    """Reads and plain stores of the body's own frame become `yield from` the helpers."""

    def __init__(self):
        self.points = 0

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if type(node.ctx) is ast.Load and node.attr in READS:
            self.points += 1
            call = ast.Call(func=ast.Name(id=READ_PARAM, ctx=ast.Load()),
                            args=[node.value, ast.Constant(value=node.attr)], keywords=[])
            return _located(ast.YieldFrom(value=call), node)
        return node

    def visit_Assign(self, node):
        target = node.targets[0] if len(node.targets) == 1 else None
        if type(target) is not ast.Attribute or target.attr not in WRITES:
            return self.generic_visit(node)
        value = self.visit(node.value)
        obj = self.visit(target.value)
        self.points += 1
        call = ast.Call(func=ast.Name(id=WRITE_PARAM, ctx=ast.Load()),
                        args=[value, obj, ast.Constant(value=target.attr)], keywords=[])
        return _located(ast.Expr(value=ast.YieldFrom(value=call)), node)

    # nested scopes hold no read (`refusal`), and are left exactly as written
    def _leave(self, node):
        return node

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _leave
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _leave


class _Desugarer(ast.NodeTransformer):
    """Statements holding a comprehension `_desugarable` accepts become the loop it runs:

        x = [f(v.output) for v in vs if c(v)]
    ->  __interlace_loop_1__ = []
        for __interlace_loop_1_v__ in vs:
            if c(__interlace_loop_1_v__):
                __interlace_loop_1__.append(f(__interlace_loop_1_v__.output))
        x = __interlace_loop_1__
        del __interlace_loop_1__

    The targets are renamed, as a comprehension's own scope keeps them from the body's
    names; the first iterable is evaluated where the comprehension evaluated it. Only
    comprehensions with a read in them are desugared (the others stay as they are)."""

    def __init__(self):
        self.count = 0

    def _statement(self, node):
        comprehension = _desugarable(node)
        if comprehension is None or not any(
                type(n) is ast.Attribute and (n.attr in READS) for n in ast.walk(comprehension)):
            return node
        self.count += 1
        result = f"__interlace_loop_{self.count}__"
        renames = {}
        for generator in comprehension.generators:
            for name in ast.walk(generator.target):
                if type(name) is ast.Name:
                    renames[name.id] = f"__interlace_loop_{self.count}_{name.id}__"
        rename = _Renamer(renames)
        kind = type(comprehension)
        if kind is ast.ListComp:
            empty = ast.List(elts=[], ctx=ast.Load())
            add = ast.Expr(value=ast.Call(func=ast.Attribute(value=_name(result), attr="append", ctx=ast.Load()),
                                          args=[rename.visit(comprehension.elt)], keywords=[]))
        elif kind is ast.SetComp:
            empty = ast.Set(elts=[ast.Starred(value=ast.Tuple(elts=[], ctx=ast.Load()), ctx=ast.Load())])  # {*()}
            add = ast.Expr(value=ast.Call(func=ast.Attribute(value=_name(result), attr="add", ctx=ast.Load()),
                                          args=[rename.visit(comprehension.elt)], keywords=[]))
        else:
            empty = ast.Dict(keys=[], values=[])
            add = ast.Assign(targets=[ast.Subscript(value=_name(result), slice=rename.visit(comprehension.key),
                                                    ctx=ast.Store())],
                             value=rename.visit(comprehension.value))
        inner = [add]
        for index in range(len(comprehension.generators) - 1, -1, -1):
            generator = comprehension.generators[index]
            for condition in reversed(generator.ifs):
                inner = [ast.If(test=rename.visit(condition), body=inner, orelse=[])]
            iterable = generator.iter if index == 0 else rename.visit(generator.iter)
            inner = [ast.For(target=_Renamer(renames, store=True).visit(generator.target), iter=iterable,
                             body=inner, orelse=[])]
        # the renamed targets are bound first and deleted after, so that none outlives the loop
        temporaries = [result, *renames.values()]
        statements = [ast.Assign(targets=[_name(t, ast.Store()) for t in temporaries[1:]],
                                 value=ast.Constant(value=None))] if renames else []
        statements += [ast.Assign(targets=[_name(result, ast.Store())], value=empty)] + inner
        value = node.value
        if type(value) is ast.Call:  # `save([...])`: the call, now of the finished value
            value.args = [_name(result)]
            tail = value
        else:
            tail = _name(result)
        if type(node) is ast.Assign:
            statements.append(ast.Assign(targets=node.targets, value=tail))
        elif type(value) is ast.Call:
            statements.append(ast.Expr(value=tail))
        statements.append(ast.Delete(targets=[_name(t, ast.Del()) for t in temporaries]))
        return [_located(statement, node) for statement in statements]

    visit_Assign = visit_Expr = _statement

    def _leave(self, node):
        return node

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _leave


class _Renamer(ast.NodeTransformer):
    def __init__(self, renames, store=False):
        self.renames = renames
        self.store = store

    def visit_Name(self, node):
        new = self.renames.get(node.id)
        if new is None:
            return node
        return ast.copy_location(ast.Name(id=new, ctx=ast.Store() if self.store else node.ctx), node)


def _name(identifier, ctx=None):
    return ast.Name(id=identifier, ctx=ctx or ast.Load())


def _located(new, old):
    ast.copy_location(new, old)
    for child in ast.walk(new):
        if not hasattr(child, "lineno") or child.lineno is None:
            ast.copy_location(child, old)
    return new


def rewrite(module):
    """The body function's module (`syntax.function_module`'s shape: one function whose last
    parameter is the locals one) as a generator function: reads become yield points and the
    hidden parameters `HIDDEN` follow the locals one. Returns (module, number of points).
    A body without a read point is made a generator by a dead `if 0: yield`."""
    module = copy.deepcopy(module)  # the Block's statements are shared with its other bodies
    function = module.body[0]
    if type(function) is not ast.FunctionDef:
        raise TypeError("rewrite() needs the body function's module (one function definition)")
    desugarer = _Desugarer()
    body = []
    for statement in function.body:
        done = desugarer.visit(statement)
        body.extend(done if isinstance(done, list) else [done])
    rewriter = _Rewriter()
    function.body = [rewriter.visit(statement) for statement in body]
    if not rewriter.points:  # a generator all the same (dead code: only the compiler sees it)
        function.body.insert(0, ast.If(test=ast.Constant(value=0), body=[ast.Expr(value=ast.Yield(value=None))],
                                       orelse=[]))
    loc = dict(lineno=function.lineno, col_offset=0, end_lineno=function.lineno, end_col_offset=0)
    function.args.args = function.args.args + [ast.arg(arg=name, annotation=None, **loc) for name in HIDDEN]
    return ast.fix_missing_locations(module), rewriter.points


def _read_at_once(obj, name):
    return Ready(getattr(obj, name))


read = frames.Reader("__interlace_read__", _read_at_once)
"""`read(obj, name)`: `obj.<name>` in a generator body, as what the body's `yield from` runs:
the iterator `type(obj).__interlace_read__(obj, name)` returns (it yields while the value is
not there yet, and returns it), else the value read at once (`Ready`). Compiled: no Python
frame per read."""


def _write_at_once(value, obj, name):
    setattr(obj, name, value)
    return Ready(None)


write = frames.Writer("__interlace_write__", _write_at_once)
"""`write(value, obj, name)`: `obj.<name> = value` in a generator body, as what the body's
`yield from` runs: the iterator `type(obj).__interlace_write__(obj, name, value)` returns
(it yields while the location is not there yet), else the assignment made at once
(`Ready(None)`). Compiled: no Python frame per assignment."""


class Ready:
    """An iterator that yields nothing and returns `value`: `yield from Ready(v)` is `v`."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __iter__(self):
        return self

    def __next__(self):
        value = self.value
        self.value = None
        raise StopIteration(value)


DEFAULTS = (read, write)
"""The hidden parameters' defaults, in `HIDDEN` order."""
