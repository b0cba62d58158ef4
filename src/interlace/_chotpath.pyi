"""Stub of the compiled interleaving hot path (csrc/_chotpath.pyx); twin: _pyhotpath.py."""

from typing import Any, Callable, Optional

RELAXED: int
POOL_MAX: int

class Hub:
    counts: list[int]
    exact: list[bool]
    parked: dict[int, dict[int, list[Any]]]
    nparked: int
    calls: int
    position: int
    root: int
    visits: Optional[tuple[int, ...]]
    positions: Optional[tuple[tuple[int, ...], ...]]
    record: Optional[list[int]]
    def __init__(
        self,
        nkeys: int,
        root: int,
        visits: Optional[tuple[int, ...]],
        positions: Optional[tuple[tuple[int, ...], ...]],
        learning: bool,
    ) -> None: ...
    def fire(self, key: int) -> int: ...
    def so_far(self, key: int) -> int: ...
    def observe(self, key: int) -> None: ...
    def park(self, key: int, occ: int, waiter: Any) -> None: ...
    def take(self, key: int, occ: int) -> Optional[list[Any]]: ...
    def drain(self) -> list[tuple[int, int, Any]]: ...

class Pointer:
    iteration: int
    pinned: int
    depth: int
    def __init__(self) -> None: ...
    def bind(self, upcoming: int) -> int: ...
    def pin(self, n: int) -> None: ...
    def save(self) -> tuple[int, int, int]: ...
    def restore(self, state: tuple[int, int, int]) -> None: ...

PARKED: int
DONE: int
FAILED: int
STOPPED: int
UNWIND_STOP: bool

def outermost(fn: Callable[[], Any]) -> Any: ...

class MediatorCore:
    index: int
    rows: Any
    pointer: Any
    worker: Any
    event: Optional[Event]
    body_grad: Optional[bool]
    finished: bool
    fn: Any
    error: Optional[BaseException]
    label: Any
    parks: int
    def __init__(self, fn: Any = None, index: int = 0, rows: Any = None, label: Any = "trace body") -> None: ...
    def start(self, pool: Optional[list] = None) -> Any: ...
    def start_generator(self, worker: GenCore, pool: Optional[list] = None) -> Any: ...
    def start_generator_job(self, pool: Optional[list] = None) -> Any: ...
    def release(self, pool: Optional[list]) -> None: ...

def configure(
    getcurrent: Callable[[], Any],
    is_grad_enabled: Callable[[], bool],
    set_grad_enabled: Callable[[bool], Any],
    new_worker: Callable[[], Any],
    idle_workers: Callable[[], list],
    enter_body: Optional[Callable[[Any], Any]] = None,
    exit_body: Optional[Callable[[Any], Any]] = None,
    gen_worker: Optional[Callable[[Any, Any, Any], Any]] = None,
) -> None: ...

def configure_express(
    force_eager: Callable[[], Any],
    restore: Callable[[Any], Any],
    close_body: Callable[[Any, Any, Any], Any],
    stops: tuple,
    hidden: tuple,
) -> None: ...

class GenCore:
    gen: Any
    context: Any
    token: Any
    mediator: Any
    home: Any
    dead: bool
    def __init__(self, mediator: Any = None, gen: Any = None, state: Any = None) -> None: ...
    def end(self) -> None: ...
    def returned(self, values: Any) -> Any: ...
    def switch(self, payload: Any = None) -> Any: ...

def envoy_reader(output: Any, policy: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]: ...

def envoy_indexer(slow: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]: ...

def runs_here(mediator: MediatorCore) -> bool: ...

class GenRead:
    def __iter__(self) -> GenRead: ...
    def __next__(self) -> Any: ...
    def send(self, payload: Any) -> Any: ...

class Event:
    key: int
    occ: int
    value: Any
    replaced: bool
    def __init__(self, key: int, occ: int, value: Any) -> None: ...

class Exchange:
    hub: Optional[Hub]
    current: Optional[MediatorCore]
    bypass: int
    thread: int
    routed: Optional[Callable[[int, int, Any], Any]]
    message: Optional[Callable[[MediatorCore, Any, Event], None]]
    paused: Optional[Callable[[MediatorCore, Event], None]]
    done: bool
    root_call: bool
    tapper: Optional[Taps]
    pool: Optional[list]
    row_type: Optional[type]
    axes: Optional[dict]
    backward: bool
    def __init__(
        self,
        is_grad_enabled: Callable[[], bool],
        set_grad_enabled: Callable[[bool], Any],
        routed: Optional[Callable[[int, int, Any], Any]] = None,
        message: Optional[Callable[[MediatorCore, Any, Event], None]] = None,
        getcurrent: Optional[Callable[[], Any]] = None,
    ) -> None: ...
    def begin(self, hub: Hub, thread: int, root_call: bool = False, pool: Optional[list] = None) -> None: ...
    def end(self) -> None: ...
    def route(self, key: int, on: bool = True) -> None: ...
    def grow(
        self,
        nkeys: int,
        visits: Optional[tuple[int, ...]] = None,
        positions: Optional[tuple[tuple[int, ...], ...]] = None,
    ) -> None: ...
    def pre_hook(self, key: int) -> Callable[[Any, tuple, dict], Optional[tuple[tuple, dict]]]: ...
    def post_hook(self, key: int) -> Callable[[Any, tuple, Any], Any]: ...
    def handoff(self, key: int, value: Any) -> Optional[Event]: ...
    def deliver(self, key: int, occ: int, value: Any) -> Optional[Event]: ...
    def hook_event(self, key: int, pre: bool, args: Any, third: Any) -> Any: ...
    def serve(self, event: Event, waiters: list[MediatorCore]) -> None: ...
    def wait_for(self, mediator: MediatorCore, key: int, occ: int) -> Any: ...
    def request(self, key: int, mediator: Optional[MediatorCore] = None) -> Event: ...
    def prepare(self, mediator: MediatorCore, key: int) -> Optional[Event]: ...
    def read(self, key: int) -> Any: ...
    def start_all(self, mediators: Any) -> None: ...
    def reader(self, key: int) -> Any: ...
    def resume(self, mediator: MediatorCore, event: Any, payload: Any = None) -> Any: ...

class Hook:
    exchange: Exchange
    key: int
    pre: bool
    def __init__(self, exchange: Exchange, key: int, pre: bool) -> None: ...
    def call(self, module: Any, args: tuple, third: Any) -> Any: ...
    def __call__(self, module: Any, args: tuple, third: Any) -> Any: ...

UNSET: object

class Taps:
    handles: dict
    taps: dict
    tapped: dict
    def __init__(self, state: Any, global_hooks: tuple, enabled: bool) -> None: ...
    def know(self, index: int, cls: type) -> None: ...
    def install(self, run: Exchange, key: int, root_call: bool) -> bool: ...
    def tap(self, run: Exchange, key: int, index: int) -> None: ...
    def remove(self) -> list | None: ...

class Tap:
    exchange: Exchange
    original: Any
    pre: int
    post: int
    def __init__(self, exchange: Exchange, original: Any) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    @property
    def __wrapped__(self) -> Any: ...
    def __getattr__(self, name: str) -> Any: ...

BODY_START: int
FORWARD: int
RETURNED: int
ROOT_FIRED: int
RESULT_FIRED: int

class ExpressCore:
    want: int
    stage: int
    position: int
    result_key: int
    positions: Any
    interleaver: Any
    gen: Any
    context: Any
    body_grad: Any
    wrapped: dict
    plans: dict
    served: list
    serving: int
    value: Any
    replaced: bool
    engine: Any
    state: Any
    body: Any
    out: Any
    token: Any
    dead: bool
    worker: Any
    error: Any
    event: Any
    last_write: Any
    cut: bool
    def __init__(self, global_hooks: tuple) -> None: ...
    def run(self, engine: Any, body: Any, out: dict, args: tuple, kwargs: dict) -> Any: ...
    def ahead(self, key: int) -> bool: ...
    def begin(self, positions: Any, result_key: int, gen: Any, state: Any) -> Any: ...
    def end(self) -> None: ...
    def unwrap(self) -> None: ...
    def serve(self, key: int, value: Any) -> Any: ...
    def switch(self, payload: Any) -> Any: ...

class PlanCheck:
    def __init__(self) -> None: ...

class ExpressTap:
    key: int
    original: Any
    def __init__(self, ref: Any, key: int, original: Any) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    @property
    def __wrapped__(self) -> Any: ...
    def __getattr__(self, name: str) -> Any: ...

def call_below(depth: int, fn: Callable[[], Any]) -> Any: ...
