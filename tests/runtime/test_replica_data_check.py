"""The first-batch check for IterableDatasets (one process here; two ranks reading DDP-style shards
at tp2 and pp2 are in tests/test_user_habits_round3.py)."""
import torch
from torch.utils.data import DataLoader, IterableDataset

from megastrategy.runtime.replica_data_check import ReplicaDataCheck, batch_fingerprint


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_fingerprints_tell_equal_batches_from_different_ones():
    batch = {"ids": torch.arange(6).view(2, 3), "tag": "x"}
    same = {"ids": torch.arange(6).view(2, 3), "tag": "x"}
    assert batch_fingerprint(batch) == batch_fingerprint(same)
    assert batch_fingerprint(batch) != batch_fingerprint({"ids": torch.arange(6).view(2, 3) + 1, "tag": "x"})
    assert batch_fingerprint(batch) != batch_fingerprint({"ids": torch.arange(6).view(3, 2), "tag": "x"})


def test_only_an_iterable_dataset_arms_the_check():
    check = ReplicaDataCheck(None, [0, 1])
    check.arm(DataLoader(list(range(4))))
    assert not check._armed
    check.arm(DataLoader(Stream()))
    assert check._armed
