"""Lightning's summary of a split model counts the whole model: shards summed over the
model-parallel ranks without their padding, replicated parameters once."""
import lightning as L
import torch
from torch import nn

from megastrategy.layers.shard_spec import ShardSpec, set_shard_spec
from megastrategy.whole_model_summary import WholeModelSummary, whole_count
from tests.helpers.dist import run_distributed


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 51, bias=False)  # a vocabulary of 101 padded to 102, split over 2 ranks
        self.norm = nn.LayerNorm(4)
        set_shard_spec(self.head.weight, ShardSpec(dim=0, full_size=101, padded_size=102))


def test_a_padded_shard_counts_its_share_of_the_real_size():
    assert whole_count(Tiny().head.weight) == 51 * 4 * 101 / 102


def _summary(rank, world):
    summary = WholeModelSummary(Tiny(), 1, counted=lambda p: True, group=None,
                                replicated_here=lambda p: hasattr(p, "megastrategy_shard") or rank == 0)
    return summary.param_nums, summary.total_parameters, summary.trainable_parameters


def test_counts_are_summed_over_the_ranks():
    one_device = 101 * 4 + 8
    for nums, total, trainable in run_distributed(_summary, 2):
        assert nums == [101 * 4, 8]  # the head's two shards, the norm once
        assert total == trainable == one_device + 8  # ``counted`` said every rank adds the norm
