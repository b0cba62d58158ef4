"""The torch-free tracer core: capture a `with` body, skip it, run it through a backend."""

from .backend import Backend
from .save import save
from .tracer import Tracer

__all__ = ["Backend", "Tracer", "save"]
