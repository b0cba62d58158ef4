"""Stub of the compiled interleaving hot path (csrc/_chotpath.pyx); twin: _pyhotpath.py."""

from typing import Any, Optional

RELAXED: int

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
