"""Policy of skipping a `with` body: plan, arm, suppresses, disarm, write_back.

The body of `with tracer:` must not run inline: the Tracer runs it through a backend. The
frame mechanism lives in the native extension (`interlace._cframes`) or its pure-Python twin
(`interlace._pyframes`), chosen by `interlace._native`; this module decides what to ask of it.

How the native path skips, per version (the whole story: docs/skip.md):

* 3.10/3.11 - a one-shot C trace function. `arm` installs it with `PyEval_SetTrace`,
  *chained*: it remembers the thread's previous C trace function and object, forwards every
  event it does not consume to them, and consumes exactly one event: the line (or opcode)
  event at the body start of the armed frame. Bodies that share the with's line get no line
  event, so `arm` also sets the frame's per-opcode event flag for the few instructions of the
  `as` binding (opcode events are forwarded only if that flag was already set). At the body
  start it writes the frame's instruction pointer to the with's verified normal exit (the
  eval loop reloads it after a trace call) and puts the previous tracer and the flag back
  exactly; on 3.11 it then hands the chained tracer the with line's event for the exit,
  which 3.10 emits by itself, so a chained tracer sees the inline stream minus the body's
  lines. This is not "installing a tracer" in any sense a user can observe: nothing
  Python-visible changes (`sys.gettrace()` and the frame's own trace function are never
  touched, the line number is never written), the window lasts from the end of __enter__ to
  the body start, and a user's tracer, coverage or pdb see every event they would have seen.
* 3.12/3.13 - `sys.monitoring` under our own tool id. LINE events are enabled once per code
  object (locally); a C callback returns DISABLE for lines that start no with body and, in an
  armed frame at its body start, writes the instruction pointer to the verified exit. Bodies
  that do not start a new line (`with T(): x = 1`, `with T(), B():`) use INSTRUCTION events
  and raise `SkipSignal`, which `__exit__` suppresses (`suppresses`). Unarmed frames at the
  same site (another thread, a context manager that is not a tracer) run the body inline.
  Tools 6/7 (the interpreter's own settrace/setprofile) are called before ours, so a Python
  tracer sees the body's first line in the caller's frame before the jump.
* 3.12/3.13 unchecked reads - the compiler reads a local the body always binds with an
  unchecked LOAD_FAST after the block; skipping the body would make that read NULL (a crash).
  At the first plan for a code object every LOAD_FAST of a body-bound name becomes
  LOAD_FAST_CHECK in place (same size, same meaning when bound; 3.12's quickened pairs are
  split first). 3.13's fused LOAD_FAST_LOAD_FAST has no checked form: one that lies in the
  verified tail after the normal exit becomes a JUMP_FORWARD to the same instruction in the
  handler's copy of that tail (which the compiler emitted checked); where that is not
  possible the site skips by raising, whose continuation is already checked. A body whose
  first statement is a `try` cannot skip by raising (the `try`'s handlers would run), so
  there each fused read of a body-bound name gets a *guard* instead: an INSTRUCTION event
  on that unit whose callback raises UnboundLocalError, as a checked read would, when a
  local it reads is unbound, and otherwise lets the read run.

The twin raises at the body start (`sys.monitoring` on 3.12+, a chained Python trace
function on 3.10/3.11); it refuses shapes it cannot raise at (same-line and `try`-first
bodies). See `interlace._pyframes`.
"""

from __future__ import annotations

import threading
import weakref

from .. import _native
from ..errors import UnsupportedBlockError
from . import sites
from .. import versions as V

frames = _native.frames
SkipSignal = frames.SkipSignal
_frames_arm = frames.arm
_frames_disarm = frames.disarm


class SkipPlan:
    """How to skip one with site: decided once per code object and instruction.

    A plain class rather than a dataclass (`dataclasses` would cost `import interlace` ms).
    It holds no reference to its code object, so that a plan kept with the code (the warm
    record `frames.register_site` makes) does not keep the code alive.
    """

    __slots__ = ("site", "mode", "filename", "lineno", "arm_args")

    def __init__(self, site: sites.Site, mode: int, filename: str, lineno: int, same_line=False):
        self.site = site
        self.mode = mode              # frames.JUMP / RAISE_LINE / RAISE_INSTRUCTION
        self.filename = filename
        self.lineno = lineno
        exit_unit = site.exit_unit if site.exit_unit is not None else -1
        # Without sys.monitoring a body start that shares the with's line gets no line
        # event: the one-shot trace function then asks for opcode events.
        flags = frames.OPCODE_EVENTS if same_line and not V.HAS_MONITORING else 0
        self.arm_args = (site.body_start, site.body_op_unit, exit_unit, mode | flags)  # for frames.arm

    @property
    def raises(self) -> bool:
        return self.mode != frames.JUMP

    def __repr__(self):
        return f"<SkipPlan {self.filename}:{self.lineno} mode={self.mode} arm={self.arm_args}>"


class _Refused:
    """A cached refusal: the same error, fresh each time it is raised."""

    __slots__ = ("error_type", "message")

    def __init__(self, error: Exception):
        self.error_type = type(error)
        self.message = str(error)


class _CodeFacts:
    """What the skip decided and changed for one code object: its plans (and refusals) by
    f_lasti, and the units it patched. Kept while the code object lives."""

    __slots__ = ("ref", "plans", "patched")

    def __init__(self, ref):
        self.ref = ref
        self.plans = {}           # f_lasti -> SkipPlan | _Refused
        self.patched = set()      # units rewritten (checked reads, redirects)


_CODES: dict = {}            # id(code) -> _CodeFacts, dropped when the code object goes
_LOCK = threading.RLock()


def _facts(code) -> _CodeFacts:
    key = id(code)
    facts = _CODES.get(key)
    if facts is None or facts.ref() is not code:
        def drop(ref, key=key):
            if getattr(_CODES.get(key), "ref", None) is ref:
                del _CODES[key]

        facts = _CODES[key] = _CodeFacts(weakref.ref(code, drop))
    return facts


def _where(block) -> str:
    return f"{block.filename}:{block.lineno}"


def _refuse(block, shape: str, instead: str):
    raise UnsupportedBlockError(f"{_where(block)}: cannot skip this `with` body: {shape}. {instead}")


def plan(frame, block) -> SkipPlan:
    """The SkipPlan of the with item that is calling __enter__ in `frame` (cached per code
    object and instruction, refusals too: a refused site raises the same error each time)."""
    code = frame.f_code
    lasti = frame.f_lasti
    with _LOCK:
        facts = _facts(code)
        made = facts.plans.get(lasti)
        if made is None:
            try:
                made = _make_plan(frame, code, block, facts)
            except UnsupportedBlockError as error:
                made = _Refused(error)
            facts.plans[lasti] = made
    if made.__class__ is _Refused:
        raise made.error_type(made.message)
    return made


def _make_plan(frame, code, block, facts) -> SkipPlan:
    try:
        site = sites.analyse(code, frame.f_lasti)
    except LookupError:
        _refuse(block, "the tracer is not entered by a `with` statement here",
                 "Use the tracer as `with ...:` directly.")
    if site.body_start < 0:
        _refuse(block, "the with statement has no body instructions", "Add a body.")
    native = frames.COMPILED
    same_line = bool(getattr(block, "same_line", False)) or not site.line_start
    first_is_try = bool(getattr(block, "first_is_try", False)) or site.body_op == "SETUP_FINALLY"
    if not native:
        build = ("Build the native extension (`python setup.py build_ext --inplace`) or unset "
                 "INTERLACE_NO_EXTENSIONS")
        if same_line:
            _refuse(block, "its body does not start on a line of its own (body on the `with` line, "
                    "or another context manager after the tracer in the same `with`), which the "
                    "pure-Python skip cannot intercept",
                    f"{build}, or move the body to its own line and put the tracer last in the `with`.")
        if first_is_try:
            _refuse(block, "its first statement is a `try`, which the pure-Python skip cannot raise "
                    "past", f"{build}, or put a statement before the `try`.")
        mode = frames.RAISE_LINE
        if V.HAS_MONITORING:
            frames.prepare(code, (site.body_start,), (), (site.body_line,))
        return SkipPlan(site, mode, block.filename, block.lineno)

    mode = frames.JUMP
    if site.exit_unit is None:
        # No normal exit to jump to (e.g. every path of the body raises): raise at the body
        # start instead (its INSTRUCTION/opcode event when it shares the with's line). Not
        # past a `try` first: its handlers would run, and on 3.11+ its first instruction is
        # outside the with's exception range.
        mode = frames.RAISE_LINE
        if first_is_try:
            _refuse(block, f"its first statement is a `try` and {site.refusal or 'it has no verified normal exit'}"
                    " (every path raises), so the skip has neither an exit to jump to nor a way to "
                    "raise past the `try`", "Put a statement before the `try`, or let the body fall "
                    "through to the end of the `with` block.")
    guards = ()
    if V.NEEDS_LOAD_CHECKS and frame.f_code.co_flags & V.CO_OPTIMIZED:
        names = set(getattr(block, "assigned_names", ()) or ())
        indices = set(sites.local_indices(code, names)) | _body_stores(code, site)
        plain, fused = sites.unchecked_reads(code, indices)
        redirects = _redirects(site, fused) if mode == frames.JUMP else None
        if redirects is not None:
            _redirect(code, redirects, facts)
        elif fused:
            if first_is_try and mode == frames.JUMP:
                # Raising at a `try`'s first statement would run its handlers, so this site
                # must jump; the fused reads it cannot redirect are guarded instead.
                guards = tuple(fused)
            elif first_is_try:
                _refuse(block, "its first statement is a `try` and a name it binds is read after "
                        "the block by a fused instruction (LOAD_FAST_LOAD_FAST) that cannot be "
                        "checked", "Put a statement before the `try`.")
            else:
                mode = frames.RAISE_LINE
        _patch(code, plain, facts)
    if V.HAS_MONITORING:
        if site.line_start and not site.fused_binding:
            frames.prepare(code, (site.body_start,), (), (site.body_line,), _prev_unit(code, site), guards)
        else:
            mode = frames.RAISE_INSTRUCTION
            frames.prepare(code, (), (site.body_start,), (), _prev_unit(code, site), guards)
    return SkipPlan(site, mode, block.filename, block.lineno, same_line)


def _redirects(site, fused) -> list | None:
    """3.13: (unit, delta) turning each fused unchecked read after the normal exit into a
    JUMP_FORWARD to the same instruction in the handler's copy of the tail (which the
    compiler emitted checked); None if some fused read cannot be redirected."""
    if not fused:
        return None
    pairs = dict(site.tail_pairs)
    out = []
    for unit in fused:
        target = pairs.get(unit)
        if target is None or not 0 <= target - (unit + 1) <= V.MAX_UNIT_JUMP:
            return None
        out.append((unit, target - (unit + 1)))
    return out


def _redirect(code, redirects, facts) -> None:
    for unit, delta in redirects:
        if unit not in facts.patched:
            frames.redirect(code, unit, delta)
            facts.patched.add(unit)


def _prev_unit(code, site) -> tuple:
    """Unit of the instruction before the body start (3.12 may fuse it with the body start)."""
    c = sites.decode(code)
    i = c.by_unit.get(site.body_start)
    return (c.units[i - 1],) if i else ()


def _body_stores(code, site) -> set:
    """Locals stored between the body start and the normal exit (belt and braces)."""
    c = sites.decode(code)
    start = c.by_unit.get(site.body_start, len(c.names))
    end = c.by_unit.get(site.exit_unit, len(c.names)) if site.exit_unit is not None else len(c.names)
    found = set()
    for i in range(start, end):
        name = c.names[i]
        if name in ("STORE_FAST", "DELETE_FAST"):
            found.add(c.args[i])
        else:
            found.update(index for op, index in V.fused_halves(name, c.args[i]) if op == "STORE_FAST")
    return found


def _patch(code, reads, facts) -> None:
    """Turn the unchecked reads ((unit, previous unit) pairs) into LOAD_FAST_CHECK, once."""
    todo = sorted(r for r in set(reads) if r[0] not in facts.patched)
    if todo:
        frames.patch_checks(code, tuple(u for u, _ in todo), tuple(p for _, p in todo))
        facts.patched.update(u for u, _ in todo)


def arm(frame, plan: SkipPlan):
    """Arm the skip; call it last in Tracer.__enter__. Returns the handle for `disarm`
    (it sits on this thread's armed stack until then)."""
    return _frames_arm(frame, *plan.arm_args)


def disarm(handle) -> bool:
    """Undo `arm`; True if the body was skipped. Tracer.__exit__ calls it first: a False
    with no exception means the body ran inline (which must never happen), and disarming
    restores any tracer state at once."""
    return _frames_disarm(handle)


def suppresses(exc_type) -> bool:
    """True if `exc_type` is our own skip signal (the twin / raise mode): the body was
    skipped cleanly and __exit__ must return True."""
    return exc_type is not None and issubclass(exc_type, SkipSignal)


def write_back(frame, values: dict) -> None:
    """Write `values` into the caller: fast locals and cells (3.10-3.13), module globals,
    class-body namespaces (the mechanism empties the `f_locals` snapshot it wrote through,
    as `release_locals` would)."""
    frames.write_back(frame, values)


def release_locals(frame, snapshot=None) -> None:
    """Empty the `f_locals` snapshot reading a function frame's locals left on it (3.10-3.12).

    The snapshot holds every local of that moment - the model, its inputs - for as long as
    the frame lives, so `del model` after a trace in the same function would free nothing.
    Emptying it loses nothing: every read of `f_locals` (or `locals()`) syncs it again from
    the real locals first. Module and class frames have no snapshot (their dict is the
    namespace itself). `snapshot`: the dict already read, to avoid syncing it again.
    """
    if V.LOCALS_SNAPSHOT and frame is not None and frame.f_code.co_flags & V.CO_OPTIMIZED:
        (frame.f_locals if snapshot is None else snapshot).clear()
