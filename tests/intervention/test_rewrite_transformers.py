"""The forward rewriter (`intervention/rewrite.py`) over the installed `transformers`.

Every module class of every modeling file has its `forward` rewritten or refused with
`SourceNotAvailable` (never another error), and for up to 30 model types built from tiny
configs, every module of the model running its rewritten forward (through a hook that hands
each operation straight on) gives what the original forwards give.
"""

import importlib
import pkgutil
import types
import warnings

import pytest
import torch

from interlace.errors import SourceNotAvailable
from interlace.intervention import rewrite

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TINY = dict(num_hidden_layers=2, hidden_size=64, vocab_size=1000, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=128, head_dim=16,
            max_position_embeddings=128)  # fmt: skip
#: The model types built from tiny configs (at most 30): common architectures of each kind.
TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "gpt_neox",
         "opt", "bloom", "falcon", "gptj", "codegen", "stablelm", "olmo", "starcoder2", "granite",
         "cohere", "persimmon", "mixtral", "xglm", "biogpt", "bert", "roberta", "electra",
         "gpt_bigcode", "mpt", "gpt_neo")  # fmt: skip


def modeling_modules():
    import transformers.models as models

    for family in pkgutil.iter_modules(models.__path__):
        try:
            package = importlib.import_module(f"transformers.models.{family.name}")
        except Exception:  # a family whose optional dependency is missing
            continue
        for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
            if info.name.startswith("modeling_") and not info.name.startswith(("modeling_tf_", "modeling_flax_")):
                try:
                    yield importlib.import_module(f"{package.__name__}.{info.name}")
                except Exception:
                    continue


class PassOn:
    """A hook that runs each operation as the original does (the rewritten code's `HOOK`)."""

    def op(self, site, receiver, fn, /, *args, **kwargs):
        return fn(*args, **kwargs)

    def bind(self, site, receiver, value, /):
        return value


def rewritten_forward(function, what):
    inner, chain = rewrite.peel(function)
    compiled = rewrite.compiled_for(inner, what)
    return rewrite.rebuild(chain, compiled.function(inner, PassOn()))


def test_every_forward_is_rewritten_or_refused():
    rewritten = refused = 0
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = list(modeling_modules())
    for module in modules:
        for cls in vars(module).values():
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)) or cls.__module__ != module.__name__:
                continue
            forward = cls.forward
            if forward in seen or not isinstance(forward, types.FunctionType):
                continue
            seen.add(forward)
            try:
                inner, _ = rewrite.peel(forward)
                compiled = rewrite.compiled_for(inner, cls.__qualname__)
            except SourceNotAvailable:
                refused += 1
                continue
            assert compiled.names == tuple(compiled.sites), cls
            rewritten += 1
    assert len(modules) > 100 and rewritten > 1000, (len(modules), rewritten, refused)


def tiny_models():
    from transformers import AutoConfig, AutoModel

    for model_type in TYPES[:30]:
        try:
            config = AutoConfig.for_model(model_type, **TINY)
            torch.manual_seed(0)
            model = AutoModel.from_config(config).eval()
        except Exception:
            continue  # a model type these sizes do not fit in this version of transformers
        if sum(p.numel() for p in model.parameters()) > 5_000_000:
            continue  # a config that ignored the tiny sizes
        ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
        try:
            with torch.no_grad():
                expected = leaves(model(input_ids=ids))
        except Exception:
            continue  # the original does not run with these sizes (a rotary dim, ...)
        yield model_type, model, ids, expected


def leaves(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in leaves(v)]
    if hasattr(value, "to_tuple"):
        return leaves(value.to_tuple())
    return []


def test_rewritten_forwards_give_the_originals_outputs():
    compared = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, model, ids, expected in tiny_models():
            for name, module in model.named_modules():
                function = type(module).forward
                if "forward" in module.__dict__ or not isinstance(function, types.FunctionType):
                    continue
                try:
                    copy = rewritten_forward(function, f"{model_type}:{name}")
                except SourceNotAvailable:
                    continue
                module.forward = types.MethodType(copy, module)
            with torch.no_grad():
                got = leaves(model(input_ids=ids))
            assert len(got) == len(expected) > 0, model_type
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=model_type)
            compared.append(model_type)
    assert len(compared) >= 10, compared
