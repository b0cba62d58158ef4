"""Tiny models for the sweep tests: a GPT-2 `Model`, an MLP `Model`, a GPT-2 `LanguageModel`.

Seeded random weights (scaled up so that edits visibly move logits), built from configs, no
downloads. The language model wraps the module in memory with a byte-level BPE tokenizer
trained on the spot. Session-scoped, like the engine's own fixtures.
"""

import pytest
import torch

import interlace

VOCAB = 1000
CORPUS = [
    "the capital of france is paris",
    "the capital of italy is rome",
    "the quick brown fox jumps over the lazy dog",
    "once upon a time there was a small model that learned to talk",
    "hello world, hello tokens, hello layers and heads",
] * 4


def _gpt2(vocab, **extra):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, **extra)
    module = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return module


@pytest.fixture(scope="session")
def gpt2():
    return _gpt2(VOCAB)


@pytest.fixture(scope="session")
def model(gpt2):
    return interlace.Model(gpt2)


@pytest.fixture(scope="session")
def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    ).eval()


@pytest.fixture(scope="session")
def mlp_model(mlp):
    return interlace.Model(mlp)


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


@pytest.fixture(scope="session")
def lm(tokenizer):
    module = _gpt2(len(tokenizer), tie_word_embeddings=False)
    module.generation_config.pad_token_id = tokenizer.eos_token_id
    return interlace.LanguageModel(module, tokenizer=tokenizer)


@pytest.fixture
def corrupt():
    return torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))


@pytest.fixture
def clean_ids():
    return torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))


def assert_clean(module):
    """No hooks or forward overrides left on `module` or any submodule."""
    for name, sub in module.named_modules():
        assert not sub._forward_hooks, f"forward hook left on {name!r}"
        assert not sub._forward_pre_hooks, f"pre-hook left on {name!r}"
        assert "forward" not in sub.__dict__, f"forward override left on {name!r}"


class Calls:
    """Counts forward passes (and their batch sizes) of a module: `with Calls(m) as c:`."""

    def __init__(self, module):
        self.module, self.sizes = module, []

    def __enter__(self):
        def pre(module, args, kwargs):
            value = args[0] if args else next(iter(kwargs.values()))
            self.sizes.append(value.shape[0])

        self.handle = self.module.register_forward_pre_hook(pre, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for every Ray test of the session: each start takes seconds.

    Skips when ray is not installed (`make test` installs it: the `ray` extra).
    """
    import os

    ray = pytest.importorskip("ray",
                              reason="executor='ray' needs ray: pip install 'interlace[ray]'")
    from interlace.sweeps.executors.ray import release

    # workers import the interlace under test (this checkout's src/, first on the driver's path)
    # rather than whichever one the environment has installed
    source = os.path.dirname(os.path.dirname(interlace.__file__))
    path = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    release()  # session-wide models must not keep actors of a cluster that is shut down
    ray.shutdown()
