"""Block: the record of a captured `with` block, and what a warm trace needs of it.

A leaf of the tracer core: it imports nothing of interlace, so the memo (`blocks.py`) and the
parser that builds a Block on a miss (`syntax.py`) both import it and not each other's
names. A Block memoises its compiled body per set of bound names; compiling one on a miss
is the tracer's step (`Tracer._body_code`), which loads the parser.
"""

from __future__ import annotations

import builtins
import threading
import types

# The body function's hidden last parameter: builtins.locals, so that a user's own `locals`
# (a local, a global) cannot change what the body returns.
LOCALS_PARAM = "__interlace_locals__"
# A generator body's hidden parameters after it: its read and write helpers (generators.py).
GENERATOR_PARAMS = ("__interlace_read__", "__interlace_write__")

_compile_lock = threading.Lock()

class Block:
    """A captured `with` block: the facts the skip needs, and the compiled body.

    Public facts (read by `tracing/skip.py` and backends):
      filename, lineno (the `with` line), end_lineno, first_body_line (line of the first code
      the skip jumps over: the first body statement, or the next item's expression when the
      tracer is not the last item of `with A(), B():`), same_line (that code is on the line
      where the header ends, e.g. `with T(): x = 1`), first_is_try, assigned_names (frozenset
      of names the body binds in the caller's scope), item_index, n_items, passonly (nothing
      to intercept: runs inline), co_name, kind ("function", "class" or "module").
    """

    _FIELDS = (
        "filename", "lineno", "end_lineno", "first_body_line", "same_line", "first_is_try",
        "assigned_names", "names", "declared_global", "item_index", "n_items", "passonly",
        "co_name", "co_qualname", "kind", "flags", "node", "statements", "source_lines",
        "first_line", "caller_locals", "callables", "_functions",
    )  # fmt: skip
    # Weakly referable: the warm-site record the frame mechanism keeps on the code object
    # (frames.register_site) must not keep a Block, whose body functions hold the globals
    # that hold that code, alive past BLOCKS.
    __slots__ = _FIELDS + ("__weakref__", "last_function", "last_generator", "route")

    def __init__(self, **facts):
        for name in self._FIELDS:
            setattr(self, name, facts.get(name))
        # (params, globals, function) of the latest deferred run without reads_as_globals:
        # a warm trace at this site finds its body function here, without a key or a lookup
        self.last_function = None
        # (params, globals, function) of the latest generator start (`DeferredBody.generator`)
        self.last_generator = None
        # How the engine runs this body (intervention/routes.py): None until it first asks,
        # then AUDIT, GENERATOR, or the reason it stays on a greenlet (a str). Per process:
        # not pickled.
        self.route = None
        self._functions = Recent(FUNCTIONS_LIMIT)  # params -> code
        self.callables = Recent(FUNCTIONS_LIMIT)  # (params, id(globals)) -> function (holds the globals)

    def __repr__(self):
        return f"<Block {self.filename}:{self.lineno} in {self.co_name} assigns {sorted(self.assigned_names)}>"

    # -- the compiled body ------------------------------------------------------------
    def function_code(self, params, steps, reads_as_globals=False, frame=None):
        """The body compiled as a function of `params` (compiled once per tuple of names),
        through the tracer `steps`' `build` and `compile` steps (`steps._body_code`).

        `reads_as_globals`: the caller's locals the body only reads and that are not in
        `params` are global lookups (`globalize_reads`), not unbound locals. `frame`: the
        caller's frame, handed to the `compile` step (None: it is gone, a stand-in goes).
        """
        key = (params, True) if reads_as_globals else params
        try:
            return self._functions[key]
        except KeyError:
            pass
        with _compile_lock:
            code = self._functions.get(key)  # (kept here: a later insertion may evict it)
            if code is None:
                code = steps._body_code(self, params, reads_as_globals, frame)
                self._register(code)
                self._functions[key] = code
        return code

    def generator_code(self, params, steps, frame=None):
        """The body compiled as a generator function of `params` (reads are yield points,
        `tracing/generators.py`), once per tuple of names, through the same steps."""
        key = ("generator", params)
        try:
            return self._functions[key]
        except KeyError:
            pass
        with _compile_lock:
            code = self._functions.get(key)
            if code is None:
                code = steps._generator_code(self, params, frame)
                self._register(code)
                self._functions[key] = code
        return code

    def stand_in_frame(self):
        """What the `compile` step reads of the caller's frame when that frame is gone (a
        deferred body run after `__exit__`, a tracer rebuilt from a pickle): `f_code` (with
        the caller's filename, name, qualified name and future flags) and `f_lineno`."""
        return StandInFrame(self)

    def _register(self, code):
        if self.item_index < self.n_items - 1:  # the body is `with <later items>: body`
            import weakref  # (capture time only)

            key = id(code)
            # Weak, and gone with the code: an entry must live exactly as long as the body
            # code it describes (without it, a `with` in that body would be read as the
            # source's outer `with`), and no longer.
            SYNTHETIC[key] = (weakref.ref(code, lambda _, key=key: SYNTHETIC.pop(key, None)), self.node, self.item_index + 1)

    # -- pickling: keep the facts and the source, drop the AST and compiled code -------
    def __getstate__(self):
        state = {name: getattr(self, name) for name in self._FIELDS}
        state.update(node=None, statements=None, callables=None, _functions=None)
        return state

    def __setstate__(self, state):
        for name in self._FIELDS:
            setattr(self, name, state.get(name))
        self._functions = Recent(FUNCTIONS_LIMIT)
        self.callables = Recent(FUNCTIONS_LIMIT)
        self.last_function = None
        self.last_generator = None
        self.route = None


class StandInFrame:
    """`Block.stand_in_frame()`: the caller's frame as far as compiling its body goes."""

    __slots__ = ("f_code",)

    def __init__(self, block):
        code = builtins.compile("", block.filename, "exec", dont_inherit=True)
        names = dict(co_name=block.co_name, co_flags=code.co_flags | (block.flags or 0), co_firstlineno=block.lineno)
        if hasattr(code, "co_qualname"):
            names["co_qualname"] = block.co_qualname
        self.f_code = code.replace(**names)

    @property
    def f_lineno(self):
        """The `with` line (a stand-in, not a frame: nothing to set)."""
        return self.f_code.co_firstlineno


#: Compiled bodies and body functions a Block keeps. One set of bound names and one globals
#: dict is the rule; a site `exec`'d with a fresh globals dict each time would otherwise keep
#: every one of those dicts alive through its function.
FUNCTIONS_LIMIT = 8


class Recent(dict):
    """A dict that keeps its latest `limit` insertions (`d[k] = v`; the oldest go first).
    Lookups are plain dict lookups; what goes is rebuilt on demand, and whoever holds an
    evicted value (a running body holds its function) keeps it."""

    __slots__ = ("limit",)

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        while len(self) > self.limit:
            try:
                del self[next(iter(self))]
            except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                break


# id(code of a compiled body) -> (weakref to the code, the source With node, index of its
# first item that the body enters): a tracer that is not the last item of `with T(), B():`
# compiles its body as `with B(): body`, whose items are then found from here rather than
# from the source (3.10 has no columns to tell the two apart on a shared line).
SYNTHETIC: dict = {}



def make_function(code, globals_):
    """A callable body: `LOCALS_PARAM` defaults to the real `locals`."""
    return types.FunctionType(code, globals_, code.co_name, (builtins.locals,))


