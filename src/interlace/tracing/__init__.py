"""The torch-free tracer core: capture a `with` body, skip it, run it through a backend.

`BLOCKS` (call site -> captured Block) and `SOURCES` (filename -> lines read once) are the
capture caches; `DeferredBody` (made by `Tracer.defer()` in a backend) runs a captured body
later, anywhere. `save` here is the function (the module is `interlace.tracing.save`, reach
it with `importlib.import_module` or `from interlace.tracing.save import ...`).
"""

from .backend import Backend
from .block import Block
from .blocks import BLOCKS
from .deferred import DeferredBody
from .save import save
from .source import SOURCES
from .tracer import Tracer

__all__ = ["BLOCKS", "SOURCES", "Backend", "Block", "DeferredBody", "Tracer", "save"]
