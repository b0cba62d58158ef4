"""Tiny GPT-2 and Llama language models, built offline and loaded back from disk.

Session-scoped: each model is built from a config with seeded random weights, saved with
`save_pretrained` next to a byte-level BPE tokenizer trained on the spot with `tokenizers`,
and then loaded back through `LanguageModel(path)` -- the same road a user takes.
"""

import pytest
import torch

CORPUS = [
    "the capital of france is paris",
    "the capital of italy is rome",
    "the quick brown fox jumps over the lazy dog",
    "once upon a time there was a small model that learned to talk",
    "interlace reads and edits the internals of models while they run",
    "hello world, hello tokens, hello layers and heads",
] * 4


def build_tokenizer():
    """A byte-level BPE tokenizer (GPT-2's scheme), with eos but, like GPT-2, no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


def build_gpt2(vocab_size, eos_id):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config)


def build_llama(vocab_size, eos_id):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=eos_id, eos_token_id=eos_id,
    )
    return LlamaForCausalLM(config)


BUILDERS = {"gpt2": build_gpt2, "llama": build_llama}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """{arch: folder} of save_pretrained'd models with their tokenizer."""
    tokenizer = build_tokenizer()
    dirs = {}
    for arch, build in BUILDERS.items():
        torch.manual_seed(0)
        module = build(len(tokenizer), tokenizer.eos_token_id)
        # Random init is small; scale weights up so tokens and edits visibly move logits.
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() > 1:
                    p.mul_(3.0)
        folder = tmp_path_factory.mktemp(arch)
        module.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        dirs[arch] = folder
    return dirs


@pytest.fixture(scope="session", params=sorted(BUILDERS))
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def model_dir(model_dirs, arch):
    return model_dirs[arch]


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The plain transformers model: the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def lm(model_dir):
    """The same weights loaded through interlace.LanguageModel(path)."""
    from interlace import LanguageModel

    return LanguageModel(model_dir)


def layers(model, arch):
    """The decoder layers of either architecture (an Envoy or the plain module alike)."""
    return model.transformer.h if arch == "gpt2" else model.model.layers


def cache_tensors(cache):
    """The key and value tensors of a model's returned cache, layer by layer: a transformers
    `Cache` object's (`layers`), or the legacy tuple of (key, value) pairs."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [t for layer in layers for t in (layer.keys, layer.values)]
    return [t for pair in cache for t in pair]


def encode(tokenizer, text):
    return torch.tensor([tokenizer(text)["input_ids"]])


class StepHooks:
    """Plain torch hooks on one module during transformers' generate: the reference.

    Records the module's output at each call (step), and applies `edit(step, output)` when
    given (its return value replaces the output, as a forward hook does).
    """

    def __init__(self, module, edit=None):
        self.module, self.edit, self.outputs = module, edit, []

    def __enter__(self):
        def hook(module, args, output):
            step = len(self.outputs)
            if self.edit is not None:
                new = self.edit(step, output)
                if new is not None:
                    output = new
            self.outputs.append(output[0].clone() if isinstance(output, tuple) else output.clone())
            return output

        self.handle = self.module.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture(scope="session")
def gpt2_lm(model_dirs):
    """The GPT-2 LanguageModel alone, for tests about one architecture's specifics."""
    from interlace import LanguageModel

    return LanguageModel(model_dirs["gpt2"])
