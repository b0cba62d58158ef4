"""nnsight 0.8's loading keywords (`task=`, `dispatch=`) and unknown keywords, by name."""

import pytest
import torch

import interlace
from interlace import LanguageModel


def test_task_text_generation_loads_the_causal_lm(model_dirs, hf_model_gpt2):
    model = LanguageModel(model_dirs["gpt2"], task="text-generation", dispatch=True)
    assert type(model._module) is type(hf_model_gpt2)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), model.trace(ids):
        logits = model.lm_head.output.save()
    with torch.no_grad():
        assert torch.equal(logits, hf_model_gpt2(ids).logits)


def test_task_classification_picks_the_sequence_classification_class(model_dirs):
    from transformers import GPT2ForSequenceClassification

    model = LanguageModel(model_dirs["gpt2"], task="text-classification", num_labels=3)
    assert isinstance(model._module, GPT2ForSequenceClassification)
    # the same class by the nnsight 0.8 name
    again = interlace.TransformersModel(model_dirs["gpt2"], task="classification", num_labels=3)
    assert isinstance(again, LanguageModel)
    assert isinstance(again._module, GPT2ForSequenceClassification)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad(), model.trace(ids):
        scores = model.output.logits.save()
    assert scores.shape == (1, 3)


def test_dispatch_false_is_accepted_and_loads_now(model_dirs):
    model = LanguageModel(model_dirs["gpt2"], dispatch=False)
    assert all(p.device.type != "meta" for p in model._module.parameters())


def test_unknown_task_names_it(model_dirs):
    with pytest.raises(ValueError, match=r"unknown task='no-such-task'.*text-generation"):
        LanguageModel(model_dirs["gpt2"], task="no-such-task")


def test_task_and_automodel_together_is_a_type_error(model_dirs):
    from transformers import AutoModelForCausalLM

    with pytest.raises(TypeError, match="both task= and automodel="):
        LanguageModel(model_dirs["gpt2"], task="text-generation", automodel=AutoModelForCausalLM)


def test_a_keyword_nobody_takes_is_a_type_error_naming_it(model_dirs):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'colour'.*task=") as info:
        LanguageModel(model_dirs["gpt2"], colour="blue")
    assert "GPT2LMHeadModel.__init__" not in str(info.value)


def test_a_config_attribute_still_goes_to_from_pretrained(model_dirs):
    model = LanguageModel(model_dirs["gpt2"], n_layer=1)
    assert len(model.transformer.h) == 1


@pytest.fixture(scope="module")
def hf_model_gpt2(model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs["gpt2"]).eval()
