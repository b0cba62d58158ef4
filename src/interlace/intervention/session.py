"""`with model.session() as session:` - several traces in one block, sharing their values.

A session is the tracer core's plain `Tracer`: its body is captured, skipped, and run
against a copy of the caller's locals, so the ordinary Python in it (loops, prints, lists)
runs as written and each `with model.trace(...)` inside runs when the body reaches it. The
traces inside are *nested* traces: each pushes every name it assigns into the session's
body (not only the saved ones), so a value read in one trace is usable in the next without
`.save()` (to patch one run's activation into another, say). The session is the save
boundary: when it ends, only the values marked with `.save()` (in a trace or in the session
body itself) come back to the caller.

`session.model` is the wrapper the session was opened on; the traces inside may be of any
model.
"""

from __future__ import annotations

from ..errors import InterlaceError
from ..tracing import Tracer


class Session(Tracer):
    """What `model.session()` returns; see the module docstring."""

    def __init__(self, model=None, backend=None):
        super().__init__(backend=backend)
        self.model = model

    def __getstate__(self):
        state = super().__getstate__()
        state["model"] = None
        return state


def check_remote(remote, what):
    """`remote=False` (nnsight's default) is accepted; remote execution is not supported."""
    if remote is not False and remote is not None:
        raise InterlaceError(
            f"{what}(remote={remote!r}): remote execution (NDIF) is not supported by interlace "
            f"yet; the block runs on the local model. Drop remote= (or pass remote=False)"
        )
