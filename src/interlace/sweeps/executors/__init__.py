"""Where a sweep's batches run: `local` (this process, this thread) or `ray` (Ray actors)."""

from __future__ import annotations

from ...errors import InterlaceError

NAMES = ("local", "ray")


def get(name):
    """The executor module for `name`; checks now (before the body is skipped) that it can run."""
    if name == "local":
        from . import local

        return local
    if name == "ray":
        from . import ray

        ray.require()
        return ray
    raise InterlaceError(
        f"executor={name!r} is not an executor; use one of {', '.join(map(repr, NAMES))}"
    )
