"""The models the workloads run on: named shapes, built offline from configs with seeded weights.

A `Subject` is one built model plus what every contender needs to address it the same way:
the token ids, a tokenizer (language-model wrappers want one), and the attribute paths of its
layers, MLPs and unembedding (`transformer.h` on GPT-2, `model.layers` on Llama). The same
shape built twice (here and in the twin's process) has the same weights: each build seeds
torch first, so results can be compared across processes.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model shape: architecture, sizes, and how many tokens one input has."""

    arch: str               # "gpt2" or "llama"
    layers: int
    hidden: int
    heads: int
    vocab: int
    tokens: int
    kv_heads: int = 0       # llama only
    intermediate: int = 0   # llama only
    note: str = ""


SHAPES = {
    "tiny": Shape("gpt2", layers=2, hidden=64, heads=4, vocab=1000, tokens=16,
                  note="GPT-2, 2 layers, n_embd 64, 16 tokens (the goals' shape)"),
    "tiny12": Shape("gpt2", layers=12, hidden=64, heads=4, vocab=1000, tokens=16,
                    note="GPT-2, 12 layers, n_embd 64, 16 tokens (the per-edit slope's shape on a CPU)"),
    "gpt2-small": Shape("gpt2", layers=12, hidden=768, heads=12, vocab=50257, tokens=16,
                        note="GPT-2 small, 12 layers, n_embd 768, 16 tokens"),
    "llama-small": Shape("llama", layers=4, hidden=256, heads=8, kv_heads=4, intermediate=688,
                         vocab=1000, tokens=32, note="Llama, 4 layers, hidden 256, 32 tokens"),
    "llama-1b": Shape("llama", layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192,
                      vocab=128256, tokens=128,
                      note="Llama 3.2 1B shape, 16 layers, hidden 2048, 128 tokens"),
    "linear": Shape("linear", layers=0, hidden=2, heads=0, vocab=0, tokens=0,
                    note="a 2x2 Linear on one row: the fixed cost of a trace"),
}

#: Shapes run when `--shapes` is not given.
DEFAULT_SHAPES = {"cpu": ("tiny", "gpt2-small", "llama-small"), "cuda": ("tiny", "gpt2-small", "llama-1b")}

#: Attribute paths, per architecture, of the layer list and of the unembedding.
PATHS = {"gpt2": ("transformer.h", "lm_head"), "llama": ("model.layers", "lm_head")}


@dataclasses.dataclass(eq=False)  # hashed by identity: wrappers are cached per subject
class Subject:
    name: str
    shape: Shape
    module: torch.nn.Module
    ids: torch.Tensor           # (1, tokens), on the device
    tokenizer: object
    device: torch.device

    @property
    def arch(self) -> str:
        return self.shape.arch

    def __post_init__(self):
        # `layers_of(root)`, `head_of(root)`: one C call each (`operator.attrgetter`), the
        # getattrs of a body written as `model.transformer.h`. Timed bodies call these, not a
        # helper of their own: its Python frames would be paid on every trace, which a user's
        # inline attribute chain (and hooks and the prototypes, which look their modules up
        # before timing) does not pay.
        layers, head = PATHS.get(self.arch, ("", ""))  # (the 2x2 Linear has neither)
        self.layers_of = operator.attrgetter(layers) if layers else None
        self.head_of = operator.attrgetter(head) if head else None

    def layers(self, root=None):
        """The layer list of `root` (the module, an interlace or nnsight envoy of it)."""
        return self.layers_of(self.module if root is None else root)

    def lm_head(self, root=None):
        return self.head_of(self.module if root is None else root)

    def rows(self, n: int) -> list:
        """`n` different single-row inputs (for invokes), seeded."""
        g = torch.Generator().manual_seed(n)
        return [torch.randint(0, self.shape.vocab, (1, self.shape.tokens), generator=g).to(self.device)
                for _ in range(n)]


def tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` ids ("t0" ... ) with eos = pad = id 0: wrappers
    that want a tokenizer get one, while inputs are given as token ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")),
                                   eos_token="t0", pad_token="t0")


def _config(shape: Shape):
    if shape.arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(n_layer=shape.layers, n_embd=shape.hidden, n_head=shape.heads,
                          vocab_size=shape.vocab, n_positions=max(128, 2 * shape.tokens + 64),
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                       intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       max_position_embeddings=max(128, 2 * shape.tokens + 64),
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)


@functools.lru_cache(maxsize=None)
def build(name: str, device: str = "cpu", dtype: str = "float32") -> Subject:
    """The subject of shape `name` (memoised: contenders share one module per shape)."""
    shape = SHAPES[name]
    torch.manual_seed(0)
    if shape.arch == "linear":
        with torch.device(device):
            module = torch.nn.Linear(2, 2).to(getattr(torch, dtype)).eval()
            x = torch.randn(1, 2, dtype=getattr(torch, dtype))
        return Subject(name, shape, module, x, None, torch.device(device))
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    with torch.device(device):
        module = AutoModelForCausalLM.from_config(_config(shape))
    module = module.to(getattr(torch, dtype)).eval()
    ids = torch.randint(0, shape.vocab, (1, shape.tokens), generator=torch.Generator().manual_seed(1))
    return Subject(name, shape, module, ids.to(device), tokenizer(min(shape.vocab, 4096)),
                   torch.device(device))
