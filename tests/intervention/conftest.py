"""Tiny models with seeded random weights, and plain-hook references to compare against.

Session-scoped: an MLP (`nn.Sequential`), GPT-2 and Llama built from configs (2 layers,
hidden 64, vocab 1000). The wrapped `Model`s are session-scoped too, so the suite also
exercises the learned-order path (every trace after a model's first one).
"""

import pytest
import torch

import interlace

VOCAB = 1000


def _seeded(build):
    torch.manual_seed(0)
    module = build()
    module.eval()
    return module


@pytest.fixture(scope="session")
def mlp():
    return _seeded(
        lambda: torch.nn.Sequential(
            torch.nn.Linear(6, 16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 4),
        )
    )


@pytest.fixture(scope="session")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )
    return _seeded(lambda: GPT2LMHeadModel(config))


@pytest.fixture(scope="session")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return _seeded(lambda: LlamaForCausalLM(config))


@pytest.fixture(scope="session")
def mlp_model(mlp):
    return interlace.Model(mlp)


@pytest.fixture(scope="session")
def gpt2_model(gpt2):
    return interlace.Model(gpt2)


@pytest.fixture(scope="session")
def llama_model(llama):
    return interlace.Model(llama)


@pytest.fixture
def x6():
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def ids():
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
