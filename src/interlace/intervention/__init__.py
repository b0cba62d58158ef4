"""The interleaving engine: Envoy tree, Engine, Interleaver, Mediator, batching, gradients."""

from .engine import Engine
from .envoy import Envoy
from .interleaver import Interleaver
from .mediator import Mediator
from .state import ModelState

__all__ = ["Engine", "Envoy", "Interleaver", "Mediator", "ModelState"]
