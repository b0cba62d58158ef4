"""Stub of the compiled frame mechanism (csrc/_cframes.pyx + _cframes_impl.c).

The pure-Python twin `interlace._pyframes` has the same names and behaviour (it always
raises instead of jumping, and cannot patch bytecode).
"""

from types import CodeType, FrameType
from typing import Any, Final, Iterable, Mapping

COMPILED: Final[bool]
JUMP: Final[int]                # move the frame to the verified normal exit
RAISE_LINE: Final[int]          # raise SkipSignal at the body start's line event
RAISE_INSTRUCTION: Final[int]   # raise SkipSignal at the body start's instruction event (3.12+)
OPCODE_EVENTS: Final[int]       # flag for arm's mode: the body start shares the with's line, so
                                # 3.10/3.11 catch it by its opcode event (no line event fires)

class SkipSignal(BaseException):
    """Raised at a body start in raise mode; suppressed by the tracer's __exit__."""

class TracerBase:
    """The Tracer's fields and __init__. Compiled: C fields the warm __enter__/__exit__ read
    and write by offset (never by attribute name), exposed under these names; unset reads as
    None, and assigning None unsets; __init__ is C too. The twin: plain attributes."""

    args: tuple       # the positional arguments the tracer was made with
    kwargs: dict      # the keyword arguments but `backend`
    block: Any        # the captured Block (kept after the run)
    backend: Any      # called with the tracer after a clean skip
    _frame: Any       # the caller's frame while the trace runs
    _plan: Any        # its SkipPlan (None: the body runs inline)
    _parent: Any      # the enclosing trace's state, read at __enter__
    _state: Any       # this trace's TraceState, made when the body first runs
    _armed: Any       # the armed skip from __enter__ until __exit__ disarms it

    def __init__(self, *args: Any, backend: Any = None, **kwargs: Any) -> None:
        """Keep `args`/`kwargs` for subclasses; `backend=None` means the default backend
        (`tracer_methods`' `default_backend`)."""

def arm(frame: FrameType, lo: int, hi: int, exit_unit: int, mode: int) -> Any:
    """Arm a skip of `frame` at body code units lo..hi; returns the handle for `disarm`,
    which sits on this thread's armed stack until then.

    3.10/3.11: installs a one-shot C trace function chained to the thread's previous one.
    3.12+: the sys.monitoring callbacks find the frame's handle on the thread's stack."""

def disarm(handle: Any) -> bool:
    """Undo `arm` (restoring any chained tracer exactly; idempotent); True if the skip fired."""

def register_site(
    code: CodeType, lasti: int, kind: type, block: Any, plan: Any, arm_args: tuple | None = ...
) -> None:
    """Record what the policy decided for the with at byte offset `lasti` of `code`, for
    tracers of type `kind`: its Block, its SkipPlan and `arm_args` (lo, hi, exit, mode), or
    plan None for a body that runs inline. Kept on the code object (compiled: its co_extra),
    so it goes with it; the Block and the type are held weakly (a record whose Block went is
    a miss). The compiled Tracer.__enter__ serves a registered site without Python."""

def site(code: CodeType, lasti: int, kind: type) -> tuple | None:
    """The record `register_site` made, (block, plan, arm_args), or None (none, or its Block
    went)."""

def look_past(code: CodeType) -> None:
    """Mark `code` as a tracer's own __enter__ (a subclass's calling super().__enter__()):
    `user_frame` and the warm path walk past its frames to the user's."""

def user_frame(frame: FrameType) -> FrameType | None:
    """`frame`, or its first caller whose code `look_past` did not mark."""

def warm_entries() -> int:
    """Tracer entries the compiled warm path served since import (0 on the twin, which has
    none: its Python __enter__ reads the same records)."""

def prepare(
    code: CodeType,
    line_units: Iterable[int],
    instruction_units: Iterable[int],
    lines: Iterable[int],
    fused_prev_units: Iterable[int] = ...,
    guard_units: Iterable[int] = ...,
) -> None:
    """3.12+: enable our tool's LINE (and INSTRUCTION) events on `code`, once; no-op before.

    3.13: each fused read at `guard_units` (LOAD_FAST_LOAD_FAST, STORE_FAST_LOAD_FAST) gets
    an INSTRUCTION event that raises UnboundLocalError when a local it reads is unbound,
    as the interpreter would for a checked read (the twin accepts none)."""

def patch_checks(code: CodeType, units: Iterable[int], prev_units: Iterable[int] = ...) -> int:
    """3.12+: rewrite the LOAD_FAST at each unit to LOAD_FAST_CHECK in place."""

def redirect(code: CodeType, unit: int, delta: int) -> None:
    """3.13: turn the fused read at `unit` into JUMP_FORWARD `delta` (into the handler's
    checked copy of the same tail)."""

def write_back(frame: FrameType, values: Mapping[str, Any]) -> None:
    """Write values into the frame: fast locals and cells, module globals, class bodies."""

def bind(frame: FrameType, names: tuple[str, ...]) -> dict[str, Any]:
    """The names of `names` bound in the frame now, in `names` order (no f_locals snapshot left)."""

def call_bound(function: Any, namespace: Mapping[str, Any], params: tuple[str, ...]) -> Any:
    """function(*[namespace[name] for name in params])."""

def pick(values: Mapping[str, Any], names: Iterable[str], saved: dict[int, Any] | None = None) -> dict[str, Any]:
    """The names of `names` in values whose value is saved (by identity; all if saved is None)."""

class Reader:
    """`reader(obj, name)`: `type(obj).<method>(obj, name)` when the type has `method`, else
    `fallback(obj, name)` (a generator body's attribute read; compiled: no Python frame)."""

    def __init__(self, method: str, fallback: Any) -> None: ...
    def __call__(self, obj: Any, name: str) -> Any: ...

class Writer:
    """`writer(value, obj, name)`: `type(obj).<method>(obj, name, value)` when the type has
    `method`, else `fallback(value, obj, name)` (a generator body's attribute assignment;
    compiled: no Python frame)."""

    def __init__(self, method: str, fallback: Any) -> None: ...
    def __call__(self, value: Any, obj: Any, name: str) -> Any: ...

def tracer_methods(
    cls: type,
    enter: Any,
    exit: Any,
    aenter: Any,
    aexit: Any,
    clean: Any,
    current: Any,
    default_backend: Any,
) -> tuple[Any, Any, Any, Any]:
    """(__enter__, __exit__, __aenter__, __aexit__) for the Tracer class (a TracerBase): C
    methods that serve a registered site (set the per-run fields, arm, disarm, call the
    backend), calling the Python `enter(self, frame)` / `exit(self, t, v, tb, fired)` for
    everything else (a site not registered for this type, exceptions other than the skip
    signal, a skip that did not fire). `current` is the trace-state ContextVar (its value
    becomes `_parent`); `default_backend` is what TracerBase.__init__ stores for
    `backend=None` (on the twin too). Every error leaving them is passed to `clean(error, signal)` first,
    which drops interlace's frames from its traceback; they add none of their own. The C
    __aenter__/__aexit__ call __enter__/__exit__ and return a done awaitable. The twin
    returns `enter`, `exit`, `aenter`, `aexit` unchanged."""

def armed_count() -> int:
    """Armed handles not yet disarmed, on any thread."""


class TraceState:
    """One trace's save set and nesting depth. Compiled: C fields (a warm trace makes it
    without a Python frame); the twin: a class with __slots__."""

    saved: dict[int, Any]   # id -> object: the values saved (shared with the enclosing traces)
    parent: "TraceState | None"  # the enclosing trace's state
    depth: int              # how deep this trace is nested (0: top level)

    def __init__(self, parent: "TraceState | None") -> None: ...

def save_hooks(
    current: Any, running: list, mount: type, descriptor: Any, on_enter: Any, on_exit: Any
) -> tuple[Any, Any]:
    """(enter_body(state) -> token, exit_body(token)): make a TraceState the current trace
    (the ContextVar `current`) while a body runs, one token per running body in `running`;
    `on_enter()` runs when `.save()` is not mounted (`object.save` is not `descriptor`) or an
    import runs (`mount.importing`), `on_exit()` when an import runs at exit. Compiled: C
    functions."""

class DeferredBase:
    """A deferred body's fields and __init__ (compiled: C fields that the C `defer` and `run`
    read by offset; the twin: __slots__). `interlace.tracing.DeferredBody` derives from it."""

    tracer: Any
    block: Any
    namespace: Any
    globals: Any
    state: Any
    _params: Any      # the body function's parameters: the names of `namespace` it mentions
    _code: Any        # the code object the latest run executes (to find its frame)
    _entry: Any       # the namespace the latest run started from

    def __init__(self, tracer: Any, namespace: Any, globals_: Any, state: Any, _params: Any = ...) -> None: ...

def deferred_methods(
    tracer_cls: type, deferred_cls: type, defer: Any, push_result: Any, run: Any, locals_param: str
) -> tuple[Any, Any, Any]:
    """(Tracer.defer, Tracer.push_result, DeferredBody.run). Compiled: C methods that serve
    the warm case (a plain `defer()` while __exit__ runs; a push; a plain `run()` whose body
    function the site's previous run left on the Block, `last_function`) with no Python
    frame, and call the Python method given, with the same arguments, for everything else.
    The twin returns `defer`, `push_result`, `run` unchanged."""

def generator_method(deferred_cls: type, generator: Any) -> Any:
    """`DeferredBody.generator`. Compiled: a C method that starts the body of a site whose
    previous start left its generator function on the Block (`last_generator`) with no
    Python frame, and calls `generator` for everything else. The twin returns `generator`."""

def object_save(descriptor: Any, save: Any) -> Any:
    """The descriptor to mount as `object.save`. Compiled: a C descriptor whose bound method
    marks the object in the current trace's state (one C call); outside a trace it calls
    `save(value)`, and classes and modules get `descriptor`'s own __get__. The twin returns
    `descriptor` unchanged."""

def function_save(save: Any) -> Any:
    """`interlace.save` as a builtin function. Compiled: `save(value)` marks `value` in the
    current trace's state (one C call); outside a trace, and any call with keywords, it is the
    Python function `save`'s. The twin returns `save` unchanged."""
