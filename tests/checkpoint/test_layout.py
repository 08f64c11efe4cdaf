"""``checkpoint/layout.py``: a rank's sharded tensor described as chunks of the user's tensor. The
chunks of all ranks, written at their offsets, rebuild the one-device tensor -- which is what
consolidating a checkpoint does -- for equal packed chunks with padding and for the unequal packed
sections of a grouped-query ``[q|k|v]`` (also stored transposed, as a ``Conv1D`` would)."""
import pytest
import torch

from megastrategy.checkpoint.layout import TensorLayout
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.shard_spec import ShardSpec, padded_size_for


def _consolidate(full: torch.Tensor, spec: ShardSpec, world: int, transposed: bool) -> torch.Tensor:
    out = torch.full_like(full, float("nan"))
    for rank in range(world):
        layout = TensorLayout("w", spec, transposed=transposed, tp_rank=rank, tp_size=world)
        for offsets, view in layout.chunks(layout.shard_full(full)):
            out[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))] = view
    return out


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("spec", [
    ShardSpec(0, 9, padded_size_for(9, 2, packed_chunks=3), packed_chunks=3),  # 3 chunks of 3, padded to 4
    ShardSpec(0, 64, 64, packed_chunks=3, packed_sections=(32, 16, 16)),  # GQA: 4 q, 2 k, 2 v heads of 8
], ids=["equal-padded", "gqa-sections"])
def test_the_chunks_of_every_rank_rebuild_the_one_device_tensor(spec, transposed):
    full = torch.randn(spec.full_size, 5)
    full = full.t().contiguous() if transposed else full
    assert torch.equal(_consolidate(full, spec, 2, transposed), full)


def test_sections_tp_does_not_divide_are_refused_with_the_rule():
    spec = ShardSpec(0, 48, 48, packed_chunks=3, packed_sections=(32, 8, 8))
    with pytest.raises(MegatronConfigError, match="size 16 does not divide the size 8 of a packed section"):
        TensorLayout("w", spec, tp_rank=0, tp_size=16).shard_full(torch.zeros(48, 2))
