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

import dataclasses
import threading

from .. import _native
from ..errors import UnsupportedBlockError
from . import sites
from .. import versions as V

frames = _native.frames
SkipSignal = frames.SkipSignal
_frames_arm = frames.arm
_frames_disarm = frames.disarm


@dataclasses.dataclass
class SkipPlan:
    """How to skip one with site (cached per code object and instruction)."""

    code: object
    site: sites.Site
    mode: int                 # frames.JUMP / RAISE_LINE / RAISE_INSTRUCTION
    filename: str
    lineno: int

    @property
    def raises(self) -> bool:
        return self.mode != frames.JUMP

    @property
    def arm_args(self) -> tuple:
        """(lo, hi, exit, mode) for frames.arm."""
        args = self.__dict__.get("_arm_args")
        if args is None:
            site = self.site
            exit_unit = site.exit_unit if site.exit_unit is not None else -1
            args = self.__dict__["_arm_args"] = (site.body_start, site.body_op_unit, exit_unit, self.mode)
        return args


_PLANS: dict = {}            # (id(code), lasti) -> SkipPlan (holds the code: ids stay unique)
_PATCHED: dict = {}          # id(code) -> (code, set of patched units)
_LOCK = threading.RLock()
_local = threading.local()


def _where(block) -> str:
    return f"{block.filename}:{block.lineno}"


def _refuse(block, shape: str, instead: str):
    raise UnsupportedBlockError(f"{_where(block)}: cannot skip this `with` body: {shape}. {instead}")


def plan(frame, block) -> SkipPlan:
    """The SkipPlan of the with item that is calling __enter__ in `frame` (cached)."""
    code = frame.f_code
    key = (id(code), frame.f_lasti)
    cached = _PLANS.get(key)
    if cached is not None and cached.code is code:
        return cached
    with _LOCK:
        cached = _PLANS.get(key)
        if cached is not None and cached.code is code:
            return cached
        made = _make_plan(frame, code, block)
        _PLANS[key] = made
        return made


def _make_plan(frame, code, block) -> SkipPlan:
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
        return SkipPlan(code, site, mode, block.filename, block.lineno)

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
    if V.NEEDS_LOAD_CHECKS and frame.f_code.co_flags & 0x1:
        names = set(getattr(block, "assigned_names", ()) or ())
        indices = set(sites.local_indices(code, names)) | _body_stores(code, site)
        plain, fused = sites.unchecked_reads(code, indices)
        redirects = _redirects(site, fused) if mode == frames.JUMP else None
        if redirects is not None:
            _redirect(code, redirects)
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
        _patch(code, plain)
    if V.HAS_MONITORING:
        if site.line_start and not site.fused_binding:
            frames.prepare(code, (site.body_start,), (), (site.body_line,), _prev_unit(code, site), guards)
        else:
            mode = frames.RAISE_INSTRUCTION
            frames.prepare(code, (), (site.body_start,), (), _prev_unit(code, site), guards)
    return SkipPlan(code, site, mode, block.filename, block.lineno)


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
        if target is None or not 0 <= target - (unit + 1) <= 255:
            return None
        out.append((unit, target - (unit + 1)))
    return out


def _redirect(code, redirects) -> None:
    entry = _PATCHED.get(id(code))
    if entry is None or entry[0] is not code:
        entry = _PATCHED[id(code)] = (code, set())
    for unit, delta in redirects:
        if unit not in entry[1]:
            frames.redirect(code, unit, delta)
            entry[1].add(unit)


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
        elif name == "STORE_FAST_STORE_FAST":
            found.update((c.args[i] >> 4, c.args[i] & 15))
        elif name == "STORE_FAST_LOAD_FAST":
            found.add(c.args[i] >> 4)
    return found


def _patch(code, reads) -> None:
    """Turn the unchecked reads ((unit, previous unit) pairs) into LOAD_FAST_CHECK, once."""
    entry = _PATCHED.get(id(code))
    if entry is None or entry[0] is not code:
        entry = _PATCHED[id(code)] = (code, set())
    todo = sorted(r for r in set(reads) if r[0] not in entry[1])
    if todo:
        frames.patch_checks(code, tuple(u for u, _ in todo), tuple(p for _, p in todo))
        entry[1].update(u for u, _ in todo)


def arm(frame, plan: SkipPlan):
    """Arm the skip; call it last in Tracer.__enter__. Returns the armed handle."""
    handle = _frames_arm(frame, *plan.arm_args)
    try:
        _local.stack.append((plan, handle))
    except AttributeError:
        _local.stack = [(plan, handle)]
    return handle


def disarm(plan: SkipPlan) -> bool:
    """Undo `arm` for the innermost armed use of `plan` on this thread; True if it skipped.

    Tracer.__exit__ should call it first: a False with no exception means the body ran
    inline (which must never happen), and disarming restores any tracer state at once.
    """
    stack = getattr(_local, "stack", None)
    if not stack:
        return False
    if stack[-1][0] is plan:
        return _frames_disarm(stack.pop()[1])
    for k in range(len(stack) - 2, -1, -1):
        if stack[k][0] is plan:
            return _frames_disarm(stack.pop(k)[1])
    return False


def suppresses(plan: SkipPlan, exc_type, exc) -> bool:
    """True if `exc` is our own skip signal (the twin / raise mode): the body was skipped
    cleanly and __exit__ must return True. Disarms the plan when it is."""
    if exc_type is not None and issubclass(exc_type, SkipSignal):
        disarm(plan)
        return True
    return False


def write_back(frame, values: dict) -> None:
    """Write `values` into the caller: fast locals and cells (3.10-3.13), module globals,
    class-body namespaces."""
    frames.write_back(frame, values)
    release_locals(frame)


def release_locals(frame, snapshot=None) -> None:
    """Empty the `f_locals` snapshot reading a function frame's locals left on it (3.10-3.12).

    The snapshot holds every local of that moment - the model, its inputs - for as long as
    the frame lives, so `del model` after a trace in the same function would free nothing.
    Emptying it loses nothing: every read of `f_locals` (or `locals()`) syncs it again from
    the real locals first. Module and class frames have no snapshot (their dict is the
    namespace itself). `snapshot`: the dict already read, to avoid syncing it again.
    """
    if V.LOCALS_SNAPSHOT and frame is not None and frame.f_code.co_flags & 0x1:  # CO_OPTIMIZED
        (frame.f_locals if snapshot is None else snapshot).clear()
