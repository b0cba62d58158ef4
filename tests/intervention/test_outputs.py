"""`outputs.rebuild`: a model output rebuilt around new values is the object its constructor
makes, whether `rebuild` makes it directly or calls the constructor.

The reference is `type(value)(**items)`, transformers' own constructor, for every
`ModelOutput` dataclass transformers defines, with the shapes of items a narrowed output
has (a first field set or not, later fields set or not).
"""

import dataclasses
from collections import OrderedDict
from typing import Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import modeling_outputs  # noqa: E402
from transformers.utils import ModelOutput  # noqa: E402

from interlace.intervention.outputs import rebuild  # noqa: E402

OUTPUT_TYPES = sorted(
    (cls for cls in vars(modeling_outputs).values()
     if isinstance(cls, type) and issubclass(cls, ModelOutput) and cls is not ModelOutput
     and dataclasses.is_dataclass(cls)),
    key=lambda cls: cls.__name__,
)


def assert_same(made, reference):
    """The same type, keys in the same order, the same objects as items, as attributes and
    by position: what a user can see of a ModelOutput."""
    assert type(made) is type(reference)
    assert list(made.keys()) == list(reference.keys())
    assert all(made[k] is reference[k] for k in reference.keys())
    assert made.__dict__.keys() == reference.__dict__.keys()
    assert all(made.__dict__[k] is reference.__dict__[k] for k in reference.__dict__)
    if type(reference).to_tuple is ModelOutput.to_tuple:  # (multimodal outputs nest others)
        assert len(made.to_tuple()) == len(reference.to_tuple())
        assert all(a is b for a, b in zip(made.to_tuple(), reference.to_tuple()))


def item_patterns(cls):
    """Items a narrowed output of `cls` may have: the first field alone, the first and the
    last, a later field alone, every field."""
    names = [f.name for f in dataclasses.fields(cls)]
    tensors = {name: torch.full((2, 3), float(i)) for i, name in enumerate(names)}
    patterns = [{names[0]: tensors[names[0]]}, dict(tensors)]
    if len(names) > 1:
        patterns += [{names[0]: tensors[names[0]], names[-1]: tensors[names[-1]]},
                     {names[-1]: tensors[names[-1]]}]
    return patterns


@pytest.mark.parametrize("cls", OUTPUT_TYPES, ids=lambda cls: cls.__name__)
def test_every_transformers_output_is_rebuilt_as_its_constructor_makes_it(cls):
    for items in item_patterns(cls):
        value = cls(**items)
        new = {k: v[:1] for k, v in value.items()}  # (one row of each, as narrowing gives)
        assert_same(rebuild(value, new), cls(**new))


def test_a_lone_first_field_that_is_not_a_tensor_goes_through_the_constructor():
    """`__post_init__` reads a lone first field of another kind as an iterator of items."""
    cls = modeling_outputs.BaseModelOutput
    value = cls(last_hidden_state=torch.ones(2, 3))
    for first in ((torch.ones(1), torch.zeros(1)), [("hidden_states", torch.ones(1))]):
        assert_same(rebuild(value, {"last_hidden_state": first}), cls(last_hidden_state=first))


@dataclasses.dataclass
class OwnInit(ModelOutput):
    logits: Optional[torch.Tensor] = None
    extra: Optional[torch.Tensor] = None

    def __post_init__(self):
        super().__post_init__()
        self.built = True  # what only the constructor does


def test_an_output_with_steps_of_its_own_goes_through_the_constructor():
    value = OwnInit(logits=torch.ones(2, 3))
    made = rebuild(value, {"logits": torch.zeros(1, 3)})
    assert made.built is True and list(made.keys()) == ["logits"]


def test_a_mapping_the_constructor_refuses_comes_back_as_a_plain_dict():
    class Strict(OrderedDict):
        def __init__(self, *, only):
            super().__init__(only=only)

    items = {"a": torch.ones(1)}
    assert rebuild(Strict(only=1), items) is items
