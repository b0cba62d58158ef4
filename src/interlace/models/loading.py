"""Loading a causal language model and its tokenizer through `transformers` Auto classes.

Kept apart from `LanguageModel` so that the wrapper stays about tracing: this module only
turns `(repo id or folder, tokenizer, device_map, dtype, **kw)` into `(module, tokenizer)`,
and turns the hub's "could not connect" into an error that says what to do offline.
"""

from __future__ import annotations

import os

from ..errors import ModelLoadError  # re-exported: its home is interlace.errors


def resolve_dtype(dtype, torch_dtype):
    """`torch_dtype=` is the older spelling of `dtype=`; accept either, not both."""
    if torch_dtype is not None:
        if dtype is not None:
            raise TypeError(
                "both dtype= and torch_dtype= were given; torch_dtype is the older name of "
                "dtype, pass only dtype="
            )
        return torch_dtype
    return dtype


# nnsight's `task=` names (transformers pipeline tasks, and the older ones transformers 5
# dropped from its pipelines) -> the Auto class that loads a model for that task.
_TASKS = {
    "text-generation": "AutoModelForCausalLM",
    "causal-lm": "AutoModelForCausalLM",
    "text2text-generation": "AutoModelForSeq2SeqLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "summarization": "AutoModelForSeq2SeqLM",
    "translation": "AutoModelForSeq2SeqLM",
    "text-classification": "AutoModelForSequenceClassification",
    "sentiment-analysis": "AutoModelForSequenceClassification",
    "classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "ner": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "fill-mask": "AutoModelForMaskedLM",
    "feature-extraction": "AutoModel",
}


def automodel_for_task(task):
    """The transformers Auto class for `task` (nnsight's `task=`), e.g. "text-generation"."""
    import transformers

    name = _TASKS.get(task)
    if name is not None:
        return getattr(transformers, name)
    try:
        from transformers.pipelines import check_task

        return check_task(task)[1]["pt"][0]
    except Exception:  # noqa: BLE001 - unknown to transformers too: say what we know
        raise ValueError(
            f"unknown task={task!r}: it names no transformers Auto class. Known tasks: "
            f"{', '.join(sorted(_TASKS))} (or any transformers pipeline task); or pass "
            f"automodel=<an Auto class> directly"
        ) from None


_OWN_KEYWORDS = "tokenizer=, device_map=, dtype= (torch_dtype=), automodel=, task=, dispatch="


def load_model(name_or_path, *, automodel=None, device_map=None, dtype=None, **kwargs):
    """`AutoModelForCausalLM.from_pretrained`, in eval mode, with a clear offline error.

    A keyword that `from_pretrained` does not take (it hands unknown ones to the model's
    `__init__`, which fails with a message about the model class) is reported as ours.
    """
    if automodel is None:
        from transformers import AutoModelForCausalLM as automodel
    if device_map is not None:
        kwargs["device_map"] = device_map
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        module = automodel.from_pretrained(name_or_path, **kwargs)
    except OSError as exc:
        raise _load_error(name_or_path, "model", exc) from exc
    except TypeError as exc:
        unknown = [name for name in kwargs if f"unexpected keyword argument '{name}'" in str(exc)]
        if not unknown:
            raise
        raise TypeError(
            f"LanguageModel() got an unexpected keyword argument {unknown[0]!r}: neither "
            f"interlace nor transformers' from_pretrained takes it. interlace takes "
            f"{_OWN_KEYWORDS}; every other keyword goes to from_pretrained (e.g. revision=, "
            f"attn_implementation=, or a config attribute to override)"
        ) from None
    return module.eval()


def load_tokenizer(name_or_path, **kwargs):
    """`AutoTokenizer.from_pretrained`, set up for batching decoder-only prompts.

    A tokenizer we load ourselves gets left padding and, when it has none, eos as its pad
    token (GPT-2 ships without one), so that `tokenizer(...)` calls the user makes agree
    with the batches interlace builds. A tokenizer the user passes in is left untouched.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except OSError as exc:
        raise _load_error(name_or_path, "tokenizer", exc) from exc
    except (ValueError, TypeError) as exc:  # a folder with weights but no tokenizer files
        raise ModelLoadError(
            f"could not load a tokenizer from {str(name_or_path)!r}: no usable tokenizer files "
            f"({exc})\n"
            "Pass tokenizer=... (a tokenizer object or a folder/repo id that has one)."
        ) from exc
    if not getattr(tokenizer, "vocab_size", 1):
        # transformers >= 5 builds an *empty* tokenizer from a folder without tokenizer files.
        raise ModelLoadError(
            f"could not load a tokenizer from {str(name_or_path)!r}: no usable tokenizer files "
            "(the tokenizer built from it has an empty vocabulary).\n"
            "Pass tokenizer=... (a tokenizer object or a folder/repo id that has one)."
        )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_error(name_or_path, what, exc) -> ModelLoadError:
    name = str(name_or_path)
    if os.path.isdir(name):
        return ModelLoadError(f"could not load the {what} from the folder {name!r}: {exc}")
    return ModelLoadError(
        f"could not load the {what} {name!r}: it is not a local folder, and the Hugging Face "
        f"hub could not provide it (offline, unreachable, or no such repo).\n"
        f"To work offline, pass the path of a folder written by save_pretrained(), e.g. "
        f"LanguageModel('/path/to/folder'), or download it once while online so that it is in "
        f"the cache.\nThe hub said: {exc}"
    )
