"""Bytecode analysis of one `with` site: where its body starts and where it may jump to.

A skip moves the caller's frame from the body start (just after the `as` binding) to the
with statement's *normal exit* (`__exit__(None, None, None)`). Finding that exit is the
delicate part: the exits CPython inlines for `return`/`break`/`continue` are the same bytes,
and 3.12+ duplicates small tail blocks, so a candidate is only accepted if the code after it
matches where the with's exception handler continues once `__exit__` returns True
(following jumps, treating LOAD_FAST_CHECK as LOAD_FAST). Instructions are decoded with the
`bytecode` library; version differences come from `versions`.
"""

from __future__ import annotations

import threading

from .. import versions as V

_NO_ARG = object()


class Site:
    """Facts about one with item, in code units (2-byte words) of its code object.

    A plain class rather than a dataclass: `dataclasses` (and the `inspect` it imports) would
    cost `import interlace` ~4 ms.
    """

    __slots__ = (
        "with_unit",      # the SETUP_WITH/BEFORE_WITH that called __enter__
        "body_start",     # first unit after the `as` binding (incl. EXTENDED_ARG prefix)
        "body_op_unit",   # unit of the real opcode there (where f_lasti points)
        "body_op",        # its name
        "body_line",      # int | None
        "line_start",     # the body start begins a new line, so a LINE event fires there
        "fused_binding",  # 3.13: the as-binding is fused with the first body read
        "exit_unit",      # verified normal exit, None if none was found
        "handler_unit",   # int | None
        "refusal",        # why no verified exit exists (shape description), or None
        "tail_pairs",     # (unit after the normal exit, same instruction after the handler)
    )  # fmt: skip

    def __init__(self, *, with_unit, body_start, body_op_unit, body_op, body_line, line_start,
                 fused_binding, exit_unit, handler_unit, refusal, tail_pairs=()):
        self.with_unit = with_unit
        self.body_start = body_start
        self.body_op_unit = body_op_unit
        self.body_op = body_op
        self.body_line = body_line
        self.line_start = line_start
        self.fused_binding = fused_binding
        self.exit_unit = exit_unit
        self.handler_unit = handler_unit
        self.refusal = refusal
        self.tail_pairs = tail_pairs

    def _facts(self):
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other):
        return type(other) is Site and self._facts() == other._facts()

    def __hash__(self):
        return hash(self._facts())

    def __repr__(self):
        return "Site(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"


class _Code:
    """One decoded code object: instruction names/args/offsets without CACHE entries."""

    def __init__(self, code):
        from bytecode import ConcreteBytecode  # here: the library costs `import interlace` ~5 ms

        cb = ConcreteBytecode.from_code(code, extended_arg=False)  # fold EXTENDED_ARG into its instruction
        self.instrs = []
        self.names = []
        self.args = []
        self.units = []      # start unit (incl. EXTENDED_ARG prefix)
        self.op_units = []   # unit of the opcode itself
        self.lines = []
        self.by_unit = {}
        unit = 0
        consts = code.co_consts
        for instr in cb:
            size = instr.size // 2
            if instr.name != "CACHE":
                index = len(self.instrs)
                self.instrs.append(instr)
                self.names.append(instr.name)
                arg = instr.arg if instr.require_arg() else _NO_ARG
                if instr.name == "LOAD_CONST":
                    arg = consts[instr.arg]
                self.args.append(arg)
                self.units.append(unit)
                self.op_units.append(unit + size - 1)
                self.lines.append(instr.lineno)
                self.by_unit[unit] = index
                self.by_unit.setdefault(unit + size - 1, index)
            unit += size
        self.table = list(getattr(cb, "exception_table", None) or [])

    def target(self, i):
        """Index of the instruction a jump at index `i` goes to."""
        unit = self.instrs[i].get_jump_target(self.units[i])
        return self.by_unit.get(unit)

    def handler_of(self, unit):
        """Target unit of the innermost exception-table entry covering `unit` (3.11+)."""
        for entry in self.table:
            if entry.start_offset <= unit <= entry.stop_offset:
                return entry.target
        return None


# id(code) -> (code, _Code). Only planning a skip reads it (a few calls per new site), so
# it keeps the latest DECODED_LIMIT code objects: a decoded function is a Python object per
# instruction, and code objects from generated sources or re-run notebook cells keep coming.
_DECODED: dict = {}
_DECODED_LOCK = threading.Lock()
DECODED_LIMIT = 64


def decode(code) -> _Code:
    """Decoded form of `code`, cached by id (3.12+ changes hash(code) when we patch it)."""
    entry = _DECODED.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    decoded = _Code(code)
    with _DECODED_LOCK:
        _DECODED.pop(id(code), None)  # (re)inserted last: the oldest entries go first
        _DECODED[id(code)] = (code, decoded)
        while len(_DECODED) > DECODED_LIMIT:
            del _DECODED[next(iter(_DECODED))]
    return decoded


def analyse(code, lasti: int) -> Site:
    """Analyse the with item whose __enter__ was called by the instruction at byte `lasti`."""
    c = decode(code)
    w = c.by_unit.get(lasti // 2)
    if w is None:  # inside an instruction's inline cache (3.12's SEND while awaiting)
        import bisect

        w = bisect.bisect_right(c.units, lasti // 2) - 1
        w = w if w >= 0 else None
    if w is not None and c.names[w] not in V.WITH_ENTER_OPS:
        # `async with`: __aenter__'s coroutine runs while the frame waits in the await loop
        k = w
        while k > 0 and w - k < 8 and c.names[k] in V.AWAIT_LOOP_OPS:
            k -= 1
        if c.names[k] in ("BEFORE_ASYNC_WITH", "SETUP_ASYNC_WITH"):
            w = k
    if w is None or c.names[w] not in V.WITH_ENTER_OPS:
        raise LookupError(f"no with-enter instruction at offset {lasti} of {code.co_name}")
    # The as-binding consumes __enter__'s result: walk until the stack is back to [exit].
    depth = 1
    i = w + 1
    fused = False
    setup = w  # the instruction whose jump target is the with's handler (3.10)
    if c.names[w] in ("BEFORE_ASYNC_WITH", "SETUP_ASYNC_WITH"):
        # the awaited __aenter__ result: skip the await loop (GET_AWAITABLE ... ) first
        i = _skip_await(c, i)
        if i < len(c.names) and c.names[i] == "SETUP_ASYNC_WITH":
            setup = i  # 3.10 sets the block up after the await
    while depth > 0 and i < len(c.names):
        name = c.names[i]
        if name == "STORE_FAST_LOAD_FAST" and depth == 1:
            fused = True          # 3.13: binding + first body read in one unit
            i += 1
            depth = 0
            break
        depth += c.instrs[i].stack_effect(jump=False)
        i += 1
    body = i
    body_line = c.lines[body] if body < len(c.lines) else None
    prev_line = c.lines[body - 1]
    line_start = body_line is not None and body_line != prev_line and not fused
    handler = None
    refusal = None
    exit_index = None
    if V.PY311_PLUS:
        # the last instruction of the `as` binding is always in the with's protected range
        # (the body start may not be: a `try:` line's NOP is in no range on 3.11+)
        handler = c.handler_of(c.op_units[body - 1])
        if handler is None:
            refusal = "no exception handler covers the body"
        else:
            exit_index, refusal = _find_exit_311(c, w, body, handler)
    else:  # 3.10
        handler = c.target(setup)
        handler = c.units[handler] if handler is not None else None
        exit_index, refusal = _find_exit_310(c, body)
    pairs = []
    candidates, exit_index = exit_index or [], None
    for candidate in candidates:
        pairs = []
        problem = _verify(c, candidate, handler, pairs)
        if problem is None:
            exit_index, refusal = candidate, None
            break
        refusal, pairs = problem, []
    return Site(
        with_unit=c.units[w],
        body_start=c.units[body] if body < len(c.units) else -1,
        body_op_unit=c.op_units[body] if body < len(c.units) else -1,
        body_op=c.names[body] if body < len(c.names) else "",
        body_line=body_line,
        line_start=line_start,
        fused_binding=fused,
        exit_unit=c.units[exit_index] if exit_index is not None else None,
        handler_unit=handler,
        refusal=refusal,
        tail_pairs=tuple(pairs),
    )


def _skip_await(c: _Code, i: int) -> int:
    while i < len(c.names) and c.names[i] in V.AWAIT_LOOP_OPS and c.names[i] != "END_SEND":
        i += 1
    if i < len(c.names) and c.names[i] == "END_SEND":
        i += 1
    return i


def _find_exit_311(c: _Code, w: int, body: int, handler: int):
    """First exit call after the body that lies in the with's *enclosing* handler context."""
    outer = c.handler_of(c.units[w])
    for i in range(body, len(c.names)):
        if c.handler_of(c.units[i]) == handler:
            continue
        n = V.is_exit_call(c.names, c.args, i)
        if n and c.handler_of(c.units[i]) == outer:
            return [i], None
    return None, "the body never falls through to the end of the with block"


def _find_exit_310(c: _Code, body: int):
    """3.10: the POP_BLOCK that closes *this* with's block, followed by the exit call.

    Walks the control flow from the body start counting blocks (SETUP_* and the
    EXCEPT_HANDLER block an exception handler runs in); ours is the POP_BLOCK reached at
    depth 1. A linear scan is not enough: a handler that always re-raises leaves its
    cleanup block's POP_BLOCK out of the code."""
    terminators = V.TERMINATORS
    seen = {}
    work = [(body, 1)]
    found = []
    while work:
        i, depth = work.pop()
        while i < len(c.names):
            if seen.get(i) == depth:
                break
            seen[i] = depth
            name = c.names[i]
            if name in V.SETUP_BLOCK_OPS:
                handler = c.target(i)
                if handler is not None:
                    work.append((handler, depth + 1))
                depth += 1
            elif name == "POP_BLOCK":
                if depth == 1:
                    if V.is_exit_call(c.names, c.args, i + 1):
                        found.append(i)
                    break
                depth -= 1
            elif name == "POP_EXCEPT":
                depth -= 1
            elif name in terminators:
                break
            elif c.instrs[i].has_jump():
                target = c.target(i)
                if target is not None:
                    work.append((target, depth))
                if c.instrs[i].is_uncond_jump():
                    break
            i += 1
    if found:
        return sorted(set(found)), None
    return None, "the body never falls through to the end of the with block"


def _after_exit(c: _Code, i: int) -> int | None:
    """Index of the first instruction after the normal exit starting at `i`."""
    if c.names[i] == "POP_BLOCK":
        i += 1
    i += V.is_exit_call(c.names, c.args, i)
    while i < len(c.names) and c.names[i] in V.AWAIT_LOOP_OPS:
        i += 1
    if i < len(c.names) and c.names[i] == "POP_TOP":
        return i + 1
    return None


def _after_suppress(c: _Code, handler_unit: int) -> int | None:
    """Index where the handler continues when __exit__ returns True."""
    i = c.by_unit.get(handler_unit)
    if i is None:
        return None
    limit = i + 40
    while i < min(limit, len(c.names)):
        if c.names[i].startswith("POP_JUMP") and c.names[i].endswith("IF_TRUE"):
            j = c.target(i)
            if j is None:
                return None
            for name in V.SUPPRESS_POPS:
                while j < len(c.names) and c.names[j] in V.TRANSPARENT_OPS:
                    j += 1
                if j >= len(c.names) or c.names[j] != name:
                    return None
                j += 1
            return j
        i += 1
    return None


def _keys(c: _Code, i: int) -> list:
    """What instruction `i` does, comparable across the two copies of a tail: checked and
    unchecked reads are equal, and 3.13's fused pairs count as their two halves."""
    name = c.names[i]
    arg = c.args[i]
    if name == V.CHECKED_LOAD:
        name = V.UNCHECKED_LOAD
    halves = V.fused_halves(name, arg)
    if halves:
        return list(halves)
    if c.instrs[i].has_jump():
        return [(name, c.target(i))]
    if name == "LOAD_CONST":
        return [(name, arg, type(arg))]  # 1 == True, but they are different constants
    return [(name, arg if arg is not _NO_ARG else None)]


def _verify(c: _Code, exit_index: int, handler_unit: int | None, pairs: list) -> str | None:
    """None if the code after the normal exit is what the suppress path runs, else why not.

    Appends to `pairs` the (normal, handler) units of instructions that start in step."""
    if handler_unit is None:
        return "no exception handler found for the with block"
    a = _after_exit(c, exit_index)
    b = _after_suppress(c, handler_unit)
    if a is None or b is None:
        return "unrecognised with-exit code"
    pending_a, pending_b = [], []
    for _ in range(32):
        if not pending_a:
            a = _follow(c, a)
            if a is None:
                return "unrecognised code after the with block"
        if not pending_b:
            b = _follow(c, b)
            if b is None:
                return "unrecognised code after the with block"
        if a == b and not pending_a and not pending_b:
            return None  # both paths reached the same instruction
        if not pending_a and not pending_b:
            pairs.append((c.units[a], c.units[b]))
        if not pending_a:
            pending_a = _keys(c, a)
            a_name = c.names[a]
            a += 1
        if not pending_b:
            pending_b = _keys(c, b)
            b += 1
        if pending_a.pop(0) != pending_b.pop(0):
            return "the code after the with's normal exit differs from its handler's"
        if not pending_a and not pending_b and a_name in V.TERMINATORS:
            return None
    return "the code after the with block is too long to compare"


def _follow(c: _Code, i: int) -> int | None:
    for _ in range(32):
        if i >= len(c.names):
            return None
        name = c.names[i]
        if name in V.TRANSPARENT_OPS:
            i += 1
        elif name in V.UNCONDITIONAL_JUMPS:
            i = c.target(i)
            if i is None:
                return None
        else:
            return i
    return None


def local_indices(code, names) -> list:
    """Indices (in co_varnames) of the plain fast locals among `names` (cells excluded)."""
    cells = set(code.co_cellvars) | set(code.co_freevars)
    return [code.co_varnames.index(n) for n in names if n in code.co_varnames and n not in cells]


def unchecked_reads(code, indices) -> tuple:
    """(unchecked LOAD_FAST of `indices` as (unit, unit of the instruction before it),
    units of 3.13 fused units reading them)."""
    c = decode(code)
    wanted = set(indices)
    plain, fused = [], []
    for i, name in enumerate(c.names):
        if name == V.UNCHECKED_LOAD and c.args[i] in wanted:
            plain.append((c.op_units[i], c.units[i - 1] if i else -1))
        elif name in V.FUSED_LOADS:
            arg = c.args[i]
            reads = {arg & 15} if name == "STORE_FAST_LOAD_FAST" else {arg >> 4, arg & 15}
            if reads & wanted:
                fused.append(c.op_units[i])
    return plain, fused
