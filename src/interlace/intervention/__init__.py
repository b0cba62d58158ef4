"""The interleaving engine: Envoy tree, Interleaver, Mediator, batching, gradients."""

from .envoy import Envoy
from .interleaver import Interleaver, ModelState
from .mediator import Mediator

__all__ = ["Envoy", "Interleaver", "Mediator", "ModelState"]
