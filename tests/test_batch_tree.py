"""Batches of any type Lightning accepts split and travel as tensors, and come back as their own type."""
import dataclasses
import pickle
from collections import UserDict

import pytest
import torch
from transformers import BatchEncoding

from megastrategy.batch_tree import flatten_batch, unflatten_batch
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.stage import iter_microbatches


def test_batch_encoding_is_walked_and_rebuilt():
    batch = BatchEncoding({"input_ids": torch.arange(8).view(4, 2), "labels": torch.ones(4)})
    leaves, spec = flatten_batch(batch)
    assert len(leaves) == 2 and all(isinstance(x, torch.Tensor) for x in leaves)
    back = unflatten_batch([x * 2 for x in leaves], pickle.loads(pickle.dumps(spec)))  # spec travels to other ranks
    assert type(back) is BatchEncoding and torch.equal(back.input_ids, torch.arange(8).view(4, 2) * 2)


def test_nested_mappings_lists_and_plain_values_keep_their_places():
    batch = {"a": [UserDict({"x": torch.zeros(4, 3)}), 5], "b": ("text", torch.ones(4))}
    leaves, spec = flatten_batch(batch)
    assert sum(isinstance(x, torch.Tensor) for x in leaves) == 2
    assert [x for x in leaves if not isinstance(x, torch.Tensor)] == [5, "text"]
    back = unflatten_batch(leaves, spec)
    assert type(back["a"][0]) is UserDict and back["a"][1] == 5 and back["b"][0] == "text"


def test_a_batch_encoding_splits_into_microbatches_of_its_own_type():
    batch = BatchEncoding({"input_ids": torch.arange(8).view(4, 2), "attention_mask": torch.ones(4, 2)})
    parts = list(iter_microbatches(batch, 2))
    assert [type(p) for p in parts] == [BatchEncoding, BatchEncoding]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])


@dataclasses.dataclass
class Fields:
    input_ids: torch.Tensor
    source: str = "tokens"


@dataclasses.dataclass
class Derived:
    x: torch.Tensor
    n: int = dataclasses.field(init=False, default=0)


def test_a_dataclass_batch_splits_field_by_field_and_comes_back_as_itself():
    """A collate_fn's dataclass (Lightning moves it field by field) was one opaque leaf: pp could not split it."""
    parts = list(iter_microbatches(Fields(torch.arange(8).view(4, 2)), 2))
    assert [type(p) for p in parts] == [Fields, Fields] and [p.source for p in parts] == ["tokens"] * 2
    assert torch.equal(parts[1].input_ids, torch.arange(4, 8).view(2, 2))
    leaves, spec = flatten_batch(Derived(torch.ones(2)))  # a field __init__ does not take: kept whole
    assert len(leaves) == 1 and type(unflatten_batch(leaves, pickle.loads(pickle.dumps(spec)))) is Derived


def test_a_batch_without_visible_tensors_splits_only_into_one():
    class Opaque:
        pass

    batch = Opaque()
    assert list(iter_microbatches(batch, 1)) == [batch]
    with pytest.raises(MegatronConfigError, match=r"num_microbatches=2.*\(Opaque\).*dataclass.*num_microbatches=1"):
        list(iter_microbatches(batch, 2))


def test_a_dataclass_with_an_init_var_stays_one_leaf():
    @dataclasses.dataclass
    class WithInitVar:
        x: torch.Tensor
        scale: dataclasses.InitVar[float] = 1.0

    leaves, spec = flatten_batch(WithInitVar(torch.ones(2)))
    assert len(leaves) == 1 and type(unflatten_batch(leaves, spec)) is WithInitVar


def test_texts_beside_their_token_ids_split_with_them_and_keep_their_type():
    batch = {"input_ids": torch.arange(8).view(4, 2), "text": ["a", "b", "c", "d"], "shape": (4, 2, 1, 1),
             "tags": ["x", "y"], "split": "train"}
    first, second = iter_microbatches(batch, 2)
    assert first["text"] == ["a", "b"] and second["text"] == ["c", "d"]
    assert first["shape"] == (4, 2, 1, 1) == second["shape"]  # numbers in a tuple: no example list
    assert first["tags"] == ["x", "y"] == second["tags"]  # not as long as the batch: whole
    assert first["split"] == "train" and torch.equal(second["input_ids"], batch["input_ids"][2:])


def test_per_example_texts_returned_by_the_steps_are_joined_in_order():
    from megastrategy.pipeline.step_output import join_step_outputs

    outputs = [{"pred": ["pos", "neg"], "loss": torch.tensor(1.0)}, {"pred": ["neg", "neg"], "loss": torch.tensor(3.0)}]
    joined = join_step_outputs(outputs, "predict_step", sizes=[2, 2])
    assert joined["pred"] == ["pos", "neg", "neg", "neg"] and joined["loss"].item() == 2.0
