"""LanguageModel loading: folders, modules in memory, dtype/device_map/kwargs, offline errors."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import interlace
from interlace import LanguageModel
from interlace.models.loading import ModelLoadError

MISSING_ID = "interlace-tests/no-such-model-anywhere"


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def test_loads_a_save_pretrained_folder(lm, hf_model, hf_tokenizer, model_dir):
    assert same_weights(lm._module, hf_model)
    assert type(lm._module) is type(hf_model)
    assert not lm._module.training
    # The tokenizer is the folder's, set up for batching decoder-only prompts.
    assert lm.tokenizer("hello world")["input_ids"] == hf_tokenizer("hello world")["input_ids"]
    assert lm.tokenizer.padding_side == "left"
    assert lm.tokenizer.pad_token == lm.tokenizer.eos_token  # the folder has no pad token
    assert hf_tokenizer.pad_token is None


def test_path_objects_and_interlace_namespace(model_dir, hf_model, hf_tokenizer):
    """`interlace.LanguageModel` (the top-level name) loads a folder given as a pathlib.Path
    exactly as transformers loads it: the same weights, tokenizer and outputs."""
    assert isinstance(model_dir, pathlib.Path)
    assert interlace.LanguageModel is LanguageModel and "LanguageModel" in dir(interlace)
    model = interlace.LanguageModel(model_dir)
    assert isinstance(model, interlace.Model) and type(model._module) is type(hf_model)
    assert same_weights(model._module, hf_model)
    assert model.tokenizer("hello world")["input_ids"] == hf_tokenizer("hello world")["input_ids"]
    ids = torch.tensor([hf_tokenizer("hello world")["input_ids"]])
    with model.trace("hello world"):
        logits = model.output.logits.save()
    with torch.no_grad():
        torch.testing.assert_close(logits, hf_model(ids).logits)


def test_wraps_a_module_in_memory(hf_model, hf_tokenizer):
    model = LanguageModel(hf_model, tokenizer=hf_tokenizer)
    assert model._module is hf_model
    assert model.tokenizer is hf_tokenizer
    assert hf_tokenizer.pad_token is None  # a tokenizer the user passes is left as it is


def test_module_in_memory_refuses_loading_options(hf_model, hf_tokenizer):
    with pytest.raises(TypeError, match=r"device_map only apply when LanguageModel loads"):
        LanguageModel(hf_model, tokenizer=hf_tokenizer, device_map="cpu")
    with pytest.raises(TypeError, match=r"revision only apply"):
        LanguageModel(hf_model, tokenizer=hf_tokenizer, revision="main")


def test_rejects_other_types():
    with pytest.raises(TypeError, match=r"takes a repo id, a folder path or a torch.nn.Module, got a value of type int"):
        LanguageModel(3)


@pytest.mark.parametrize("keyword", ["dtype", "torch_dtype"])
def test_dtype_and_its_alias(model_dir, hf_model, keyword):
    model = LanguageModel(model_dir, **{keyword: torch.float64})
    params = list(model._module.parameters())
    assert {p.dtype for p in params} == {torch.float64}
    ref = {k: v.double() for k, v in hf_model.state_dict().items()}
    assert all(torch.equal(v, ref[k]) for k, v in model._module.state_dict().items())


def test_dtype_given_twice(model_dir):
    with pytest.raises(TypeError, match=r"both dtype= and torch_dtype= were given"):
        LanguageModel(model_dir, dtype=torch.float32, torch_dtype=torch.float64)


def test_other_keywords_reach_from_pretrained(model_dir):
    model = LanguageModel(model_dir, attn_implementation="eager")
    assert model._module.config._attn_implementation == "eager"


def test_separate_tokenizer_path(model_dirs):
    model = LanguageModel(model_dirs["llama"], tokenizer=str(model_dirs["gpt2"]))
    assert type(model._module).__name__ == "LlamaForCausalLM"
    assert model.tokenizer.padding_side == "left"


@pytest.mark.slow  # starts a subprocess
def test_unreachable_hub_id_offline_names_it_and_suggests_a_folder(tmp_path):
    """HF_HUB_OFFLINE=1 in a fresh interpreter: the id is named, a local path suggested."""
    code = (
        "import interlace\n"
        "try:\n"
        f"    interlace.LanguageModel({MISSING_ID!r})\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, isinstance(e, interlace.InterlaceError))\n"
        "    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.split("\n", 1)
    assert first == "ModelLoadError True"
    assert f"could not load the model {MISSING_ID!r}" in message
    assert "not a local folder" in message
    assert "save_pretrained()" in message and "LanguageModel('/path/to/folder')" in message


def test_unreachable_hub_without_network(monkeypatch, tmp_path):
    """No HF_HUB_OFFLINE, no network: the same clear error (hub retries sped up)."""
    import huggingface_hub.constants
    import huggingface_hub.utils._http as http

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(http.time, "sleep", lambda seconds: None)
    with pytest.raises(ModelLoadError, match=rf"(?s)could not load the model '{MISSING_ID}'.*save_pretrained"):
        LanguageModel(MISSING_ID)


def test_folder_without_tokenizer(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"Pass tokenizer=") as info:
        LanguageModel(tmp_path)
    assert str(tmp_path) in str(info.value) and "no usable tokenizer files" in str(info.value)
