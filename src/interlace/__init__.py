"""interlace: read and edit the internals of PyTorch models while they run.

`import interlace` is torch-free: the tracer core loads eagerly, while the names that
need torch or transformers (`Model`, `NNsight`, `Envoy`, `LanguageModel`) load on first
use through the module `__getattr__` below.
"""

from ._native import native
from .errors import (
    BarrierError,
    BatchingError,
    BatchingWarning,
    CacheError,
    ForwardReplacedWarning,
    InterlaceError,
    IterationCutShortWarning,
    MissingExtraError,
    ModelLoadError,
    NotInTraceError,
    OutOfOrderError,
    SourceNotAvailable,
    UnknownKeywordError,
    UnsupportedBlockError,
    WithBlockNotFoundError,
)
from .tracing import Backend, Tracer, save

__version__ = "0.1.0"

# name -> (module, attribute); imported on first access so torch stays optional.
_LAZY = {
    "Model": ("interlace.models.model", "Model"),
    "NNsight": ("interlace.models.model", "Model"),
    # via models.model, which makes `Envoy(module)` a traceable root (as in nnsight 0.8)
    "Envoy": ("interlace.models.model", "Envoy"),
    "eproperty": ("interlace.intervention.envoy", "eproperty"),
    "traceable": ("interlace.intervention.tracer", "traceable"),
    "LanguageModel": ("interlace.models.language_model", "LanguageModel"),
    "TransformersModel": ("interlace.models.language_model", "TransformersModel"),
    "Inputs": ("interlace.sweeps.inputs", "Inputs"),
    "open_sweep": ("interlace.sweeps.store", "open_sweep"),
}

__all__ = [
    "native",
    "InterlaceError",
    "WithBlockNotFoundError",
    "UnsupportedBlockError",
    "OutOfOrderError",
    "NotInTraceError",
    "IterationCutShortWarning",
    "BatchingWarning",
    "ForwardReplacedWarning",
    "SourceNotAvailable",
    "BatchingError",
    "BarrierError",
    "CacheError",
    "UnknownKeywordError",
    "ModelLoadError",
    "MissingExtraError",
    "Tracer",
    "Backend",
    "save",
    *_LAZY,
]


def __getattr__(name):
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'interlace' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
