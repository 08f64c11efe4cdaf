"""Which random streams a resume on another layout continues (the saved ranks must agree)."""
from __future__ import annotations

import random

import torch

from megastrategy.checkpoint.carry_over import carry_over
from megastrategy.checkpoint.rng import capture_rng_states


def _rank(dp_rank: int, source: bool, torch_seed: int) -> dict:
    torch.manual_seed(torch_seed)
    random.seed(5)
    return {"rng": capture_rng_states(), "epoch_start_rng": [torch.get_rng_state()], "dp_rank": dp_rank,
            "data_source": source}


def test_streams_every_saved_peer_shares_carry_over_and_the_others_start_afresh():
    # tp=2 x dp=2 saved: the two tp ranks of dp rank 1 drew different torch streams (dropout on a stage)
    saved = [_rank(0, True, 1), _rank(0, False, 1), _rank(1, True, 2), _rank(1, False, 3)]
    same_dp_0 = carry_over(saved, dp_rank=0, same_dp=True)
    assert same_dp_0.kept == ["torch", "python", "numpy", "sampler"]
    assert torch.equal(same_dp_0.rng["torch"], saved[0]["rng"]["torch"])
    assert torch.equal(same_dp_0.epoch_start_rng[0], saved[0]["epoch_start_rng"][0])
    same_dp_1 = carry_over(saved, dp_rank=1, same_dp=True)
    assert "torch" in same_dp_1.fresh and "torch" not in same_dp_1.rng and "python" in same_dp_1.kept
    assert torch.equal(same_dp_1.epoch_start_rng[0], saved[2]["epoch_start_rng"][0])  # its replica's loader
    other_dp = carry_over(saved, dp_rank=0, same_dp=False)
    assert other_dp.fresh == ["torch", "sampler"] and other_dp.epoch_start_rng is None
    assert other_dp.kept == ["python", "numpy"]


def test_a_checkpoint_without_recorded_coordinates_carries_nothing():
    saved = [{"rng": capture_rng_states(), "epoch_start_rng": []}]
    result = carry_over(saved, dp_rank=0, same_dp=True)
    assert result.rng == {} and result.kept == [] and "torch" in result.fresh
