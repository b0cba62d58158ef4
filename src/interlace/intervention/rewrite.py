"""The forward rewriter behind `.source`: name a function's operations, rewrite its AST so each
one calls a hook, compile it as the original was, and cache the result per code object.

Torch-free and run-free: what a trace installs and how operations are handed over is
`source.py`. A call `f(a, k=b)` becomes `HOOK.op(site, self, f, a, k=b)` and `x = v` becomes
`x = HOOK.bind(site, self, v)`, where `HOOK` is a constant of the code object that
`Compiled.bind(hook)` replaces; names follow nnsight 0.8.1 (see `source.py`'s docstring).
The rewritten function is compiled under the original filename at the original lines and
columns, inside a shell that recreates its closure cells and its class (private-name
mangling, zero-argument `super()`). Decorator wrappers are peeled (`peel`) to the function
they wrap, and rebuilt around a rewritten copy (`rebuild`).
"""

from __future__ import annotations

import __future__
import ast
import inspect
import textwrap
import threading
import types

from ..errors import SourceNotAvailable
from ..tracing import source as _sources

HOOK = "__interlace_source_hook__"
"""The constant every rewritten operation calls `.op`/`.bind` on; replaced by a hook object."""

_SHELL = "__interlace_shell__"
_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag
_SHAPE_FLAGS = (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR
                | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR)
_FUNCTION_FIELDS = ast.FunctionDef._fields


# -- naming and rewriting ---------------------------------------------------------------------------------


def _dotted(expr):
    """`(parts, rooted)`: `self.a.b` -> (['self', 'a', 'b'], True); `f().view` -> (['view'], False)."""
    parts = []
    while True:
        if isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        elif isinstance(expr, ast.Subscript):
            expr = expr.value
        elif isinstance(expr, ast.Name):
            parts.append(expr.id)
            return parts[::-1], True
        else:
            return parts[::-1], False


def _at(node, new):
    return ast.copy_location(new, node)


class _Rewrite(ast.NodeTransformer):
    """Route every call and single-target assignment through the hook, naming each one.

    Children are visited before their parent, so names are numbered in execution order.
    """

    def __init__(self, receiver, line_offset):
        self.receiver = receiver  # the first parameter's name, passed to the hook, or None
        self.line_offset = line_offset
        self.counts = {}
        self.names = []
        self.lines = {}  # name -> line within the function's source (1 = its first line)

    def _route(self, name, method, args, keywords, node):
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        label = f"{name}_{n}"
        site = len(self.names)
        self.names.append(label)
        self.lines[label] = node.lineno - self.line_offset
        if self.receiver is None:
            receiver = _at(node, ast.Constant(value=None))
        else:
            receiver = _at(node, ast.Name(id=self.receiver, ctx=ast.Load()))
        hook = _at(node, ast.Attribute(value=_at(node, ast.Constant(value=HOOK)), attr=method,
                                       ctx=ast.Load()))
        return _at(node, ast.Call(func=hook, args=[_at(node, ast.Constant(value=site)),
                                                   receiver, *args], keywords=keywords))

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "super" and not node.args and not node.keywords:
            return node  # zero-argument super() reads its caller's frame: it stays a direct call
        self.generic_visit(node)
        parts, _ = _dotted(node.func)
        return self._route("_".join(parts) or "call", "op", [node.func, *node.args],
                           node.keywords, node)

    def visit_Assign(self, node):
        node.value = self.visit(node.value)  # the value runs before the targets
        node.targets = [self.visit(target) for target in node.targets]
        if len(node.targets) == 1:  # `a = b = v` binds one value twice: not an operation
            node.value = self._assigned(node.targets[0], node.value, node)
        return node

    def visit_AnnAssign(self, node):
        if node.value is not None:  # an annotation alone assigns nothing
            node.value = self._assigned(node.target, self.visit(node.value), node)
        return node

    def _assigned(self, target, value, node):
        if isinstance(target, (ast.Tuple, ast.List)):
            pairs = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
            if pairs and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts)):
                value.elts = [self._assigned(t, v, node) for t, v in zip(target.elts, value.elts)]
            return value
        parts, rooted = _dotted(target)
        if not rooted:
            return value
        return self._route("_".join(parts), "bind", [value], [], node)


class _NoSource(Exception):
    """Why a function cannot be rewritten (turned into SourceNotAvailable by the caller)."""


class Compiled:
    """A function's rewritten code (hook still a placeholder), its operations and its text."""

    def __init__(self, original, code, names, lines, text, receiver):
        self.original = original  # the code object it was rewritten from (the cache key)
        self.code = code
        self.names = tuple(names)
        self.sites = {name: i for i, name in enumerate(names)}
        self.lines = lines
        self.text = text  # the function's source, dedented, decorators included
        self.receiver = receiver  # name of its first parameter, or None
        self._shared = None  # (hook, code) for the in-place swap, made once

    def bind(self, hook):
        """The rewritten code with `hook` in place of the placeholder (nested code too)."""
        return _replace_hook(self.code, hook)

    def shared(self, make_hook):
        """The hook (`make_hook()`) and code installed in place: one per function, made once."""
        shared = self._shared
        if shared is None:
            with _LOCK:
                if self._shared is None:
                    hook = make_hook()
                    self._shared = (hook, self.bind(hook))
                shared = self._shared
        return shared

    def function(self, like, hook):
        """A copy of function `like` running the rewritten code with `hook`."""
        return _function_like(like, self.bind(hook), like.__closure__)


def _replace_hook(code, hook):
    consts = tuple(
        hook if type(c) is str and c == HOOK
        else _replace_hook(c, hook) if type(c) is types.CodeType
        else c
        for c in code.co_consts
    )
    return code.replace(co_consts=consts)


def _rename(code, old, new):
    """Qualified names as the original has them (the shell's prefix is an artefact)."""
    consts = tuple(_rename(c, old, new) if type(c) is types.CodeType else c
                   for c in code.co_consts)
    changes = {"co_consts": consts}
    if hasattr(code, "co_qualname") and code.co_qualname.startswith(old):
        changes["co_qualname"] = new + code.co_qualname[len(old):]
    return code.replace(**changes)


def _class_of(function):
    """The name of the class whose body defined `function` (its name mangling), or None.

    From the code's own qualified name where there is one: `functools.wraps` gives a
    decorator's wrapper the qualified name of the method it wraps, not where it is defined.
    """
    parts = getattr(function.__code__, "co_qualname", function.__qualname__).split(".")
    if len(parts) >= 2 and parts[-2] != "<locals>":
        return parts[-2]
    return None


def _function_tree(function, code):
    """(FunctionDef node, text, wrapped): the function's source parsed at its own lines/columns.

    An indented def is parsed under `if 1:`, which keeps its columns (a docstring line at
    column 0 would defeat dedenting); `wrapped` says the lines are off by that one line.
    """
    lines = _sources.lines(code.co_filename, function.__globals__)
    if not lines:
        raise _NoSource(
            f"its source cannot be read ({code.co_filename} is not a file or notebook cell "
            f"interlace can read: code compiled from a string, typed at a prompt, or a file "
            f"that is gone)"
        )
    start = code.co_firstlineno - 1
    try:
        block = inspect.getblock(list(lines[start:]))
        text = "".join(block)
        wrapped = block[0][:1] in (" ", "\t")
        tree = ast.parse(("if 1:\n" if wrapped else "") + text)
        node = tree.body[0].body[0] if wrapped else tree.body[0]
    except (SyntaxError, IndexError, AttributeError, ValueError, TypeError):
        node, text, wrapped = None, "", False
    if not isinstance(node, ast.FunctionDef) or node.name != code.co_name:
        raise _NoSource(
            f"{code.co_filename}:{code.co_firstlineno} does not hold `def {code.co_name}` "
            f"(a lambda, an async def, or a file edited since it was imported)"
        )
    return node, text, wrapped


def _compile(function, code):
    node, text, wrapped = _function_tree(function, code)
    params = node.args.posonlyargs + node.args.args
    receiver = params[0].arg if params else None
    decorators, node.decorator_list = node.decorator_list, []
    rewrite = _Rewrite(receiver, 1 if wrapped else 0)
    node = rewrite.visit(node)
    # Decorators are compiled back but never run (only the def's code object is kept): with
    # them the code's first line is the first decorator's, as in the original.
    node.decorator_list = decorators
    ast.increment_lineno(node, code.co_firstlineno - (2 if wrapped else 1))

    freevars = code.co_freevars
    class_name = _class_of(function)
    loc = dict(lineno=node.lineno, col_offset=0, end_lineno=node.lineno, end_col_offset=0)
    if class_name is not None:
        params = [name for name in freevars if name != "__class__"]
        body = []
        if class_name not in params:  # the class's name must stay a global inside the def
            body.append(ast.Global(names=[class_name], **loc))
        fields = dict(name=class_name, bases=[], keywords=[], body=[node], decorator_list=[])
        if "type_params" in _FUNCTION_FIELDS:
            fields["type_params"] = []
        body.append(ast.ClassDef(**fields, **loc))
    else:
        params, body = list(freevars), [node]
    arguments = ast.arguments(posonlyargs=[], args=[ast.arg(arg=n, **loc) for n in params],
                              vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    fields = dict(name=_SHELL, args=arguments, body=body, decorator_list=[], returns=None)
    if "type_params" in _FUNCTION_FIELDS:
        fields["type_params"] = []
    module = ast.Module(body=[ast.FunctionDef(**fields, **loc)], type_ignores=[])
    ast.fix_missing_locations(module)
    try:
        top = compile(module, code.co_filename, "exec", flags=code.co_flags & _FUTURE_FLAGS,
                      dont_inherit=True)
    except SyntaxError as error:  # pragma: no cover - the original compiled, so should this
        raise _NoSource(f"its rewritten source does not compile ({error})") from None
    new = _child(_child(top, _SHELL), class_name) if class_name else _child(top, _SHELL)
    new = _child(new, code.co_name)
    nargs = code.co_argcount + code.co_kwonlyargcount
    same = (
        new is not None
        and new.co_freevars == freevars
        and new.co_argcount == code.co_argcount
        and new.co_posonlyargcount == code.co_posonlyargcount
        and new.co_kwonlyargcount == code.co_kwonlyargcount
        and new.co_varnames[:nargs] == code.co_varnames[:nargs]
        and new.co_flags & _SHAPE_FLAGS == code.co_flags & _SHAPE_FLAGS
    )
    if not same:
        raise _NoSource(
            f"{code.co_filename}:{code.co_firstlineno} no longer matches the loaded "
            f"{code.co_name} (edited since it was imported?); restart the process"
        )
    if hasattr(new, "co_qualname"):
        new = _rename(new, new.co_qualname, code.co_qualname)
    return Compiled(code, new, rewrite.names, rewrite.lines, textwrap.dedent(text), receiver)


def _child(code, name):
    if code is None:
        return None
    for const in code.co_consts:
        if type(const) is types.CodeType and const.co_name == name:
            return const
    return None


_LOCK = threading.Lock()
_CACHE = {}  # original code object -> Compiled; the latest _CACHE_MAX (see _remember)
_CACHE_MAX = 256


def compiled_for(function, what, code=None):
    """The rewritten form of `function` (of `code`, its original code, when the function
    runs another right now), cached per code object; SourceNotAvailable if none."""
    if code is None:
        code = function.__code__
    found = _CACHE.get(code)
    if found is None:
        try:
            found = _compile(function, code)
        except _NoSource as why:
            raise SourceNotAvailable(
                f"{what}: .source cannot rewrite {function.__qualname__}: {why}. .source works "
                f"on functions written in Python in a file or notebook cell"
            ) from None
        found = _remember(_CACHE, code, found, _CACHE_MAX)
    return found


def _remember(cache, key, value, limit):
    """Keep `value` for `key`, dropping the oldest entries past `limit`.

    The keys are forwards' code objects: a program that keeps making model classes (or
    functions) would otherwise keep every one of them, its rewritten code and its source
    text for good. A dropped entry is only recompiled if asked for again; a trace running
    the rewritten code holds its own reference to it.
    """
    with _LOCK:
        value = cache.setdefault(key, value)
        while len(cache) > limit:
            del cache[next(iter(cache))]
    return value


# -- decorators -------------------------------------------------------------------------------


_CALLED = {}  # code object -> names it calls directly; the latest _CALLED_MAX
_CALLED_MAX = 1024


def _called_names(function):
    """Names the function calls directly (`f(...)`), from its source; empty when unreadable."""
    code = function.__code__
    called = _CALLED.get(code)
    if called is None:
        try:
            node, _, _ = _function_tree(function, code)
        except _NoSource:
            called = frozenset()
        else:
            called = frozenset(n.func.id for n in ast.walk(node)
                               if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
        called = _remember(_CALLED, code, called, _CALLED_MAX)
    return called


def peel(function):
    """(innermost, chain): follow decorator wrappers down to the function they wrap.

    A wrapper is peeled when it says what it wraps (`__wrapped__`, set by `functools.wraps`),
    holds that function in a closure cell and calls it by that name, and calls no other
    Python function it closes over: with several (transformers' `dynamic_rope_update`
    wrapper calls `rope_forward` and two frequency updates) the wrapper is what runs, so it
    is rewritten and the forward is reached through its call (`rope_forward_0.source`), as
    nnsight 0.8.1 does, which keeps the names ported code uses. `chain` lists
    `(wrapper, cell index)` from the outside in. A forward that merely closes over a helper it
    calls is not a wrapper (no `__wrapped__`), and a wrapper that hands its function to
    something else instead of calling it (a dispatcher) is not peeled either.
    """
    chain = []
    seen = {function}
    while function.__closure__:
        wrapped = getattr(function, "__wrapped__", None)
        if not isinstance(wrapped, types.FunctionType) or wrapped in seen:
            break
        called = _called_names(function)
        candidates = []  # cells of Python functions the wrapper calls by name
        for i, (name, cell) in enumerate(zip(function.__code__.co_freevars, function.__closure__)):
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if name in called and isinstance(inner, types.FunctionType):
                candidates.append((i, inner))
        if len(candidates) != 1 or candidates[0][1] is not wrapped:
            break
        index = candidates[0][0]
        chain.append((function, index))
        function = wrapped
        seen.add(function)
    return function, chain


def _function_like(like, code, closure):
    new = types.FunctionType(code, like.__globals__, like.__name__, like.__defaults__, closure)
    new.__kwdefaults__ = like.__kwdefaults__
    new.__qualname__ = like.__qualname__
    new.__dict__.update(like.__dict__)
    return new


def rebuild(chain, inner):
    """The wrappers of `chain` rebuilt around `inner` (new cells: the originals are shared)."""
    for wrapper, index in reversed(chain):
        cells = list(wrapper.__closure__)
        cells[index] = types.CellType(inner)
        inner = _function_like(wrapper, wrapper.__code__, tuple(cells))
    return inner
