import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _hang_on_rank1(rank, world_size):
    if rank == 1:
        import time

        time.sleep(600)
    return rank


def _raise_on_rank0(rank, world_size):
    if rank == 0:
        raise ValueError("boom on rank 0")
    return rank


def test_runs_on_real_processes():
    assert run_distributed(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_a_hang_fails_the_test_within_the_timeout():
    with pytest.raises(TimeoutError):
        run_distributed(_hang_on_rank1, 2, timeout=10)


def test_an_exception_on_one_rank_is_reported():
    with pytest.raises(AssertionError, match="boom on rank 0"):
        run_distributed(_raise_on_rank0, 2)
