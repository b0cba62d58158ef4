"""Model wrappers: `Model` for any torch module (alias `NNsight`), `LanguageModel`."""

from .model import Model

NNsight = Model

__all__ = ["Model", "NNsight", "LanguageModel"]


def __getattr__(name):
    if name == "LanguageModel":
        from .language_model import LanguageModel

        return LanguageModel
    raise AttributeError(f"module 'interlace.models' has no attribute {name!r}")
