"""Batches of any type Lightning accepts split and travel as tensors, and come back as their own type."""
import pickle
from collections import UserDict

import torch
from transformers import BatchEncoding

from megastrategy.batch_tree import flatten_batch, unflatten_batch
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
