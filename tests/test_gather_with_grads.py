"""``all_gather_with_grads`` on gloo over a group without global rank 0 (torch's own gather raised
there): the stacked values, and each rank's gradient is the sum of every rank's for its slice."""
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _gather(rank, world_size):
    from megastrategy.gather_with_grads import all_gather_with_grads

    groups = [dist.new_group([0]), dist.new_group([1, 2])]
    if rank == 0:
        x = torch.ones(2, requires_grad=True)
        all_gather_with_grads(x, groups[0]).sum().backward()
        return {"shape": [1, 2], "grad": x.grad.tolist()}
    x = torch.full((2,), float(rank), requires_grad=True)
    every = all_gather_with_grads(x, groups[1])
    (every * (rank + 1)).sum().backward()  # rank 1 weighs every slice by 2, rank 2 by 3
    return {"every": every.detach().tolist(), "grad": x.grad.tolist()}


def test_gather_over_a_group_without_rank_zero():
    results = run_distributed(_gather, 3)
    assert results[0]["grad"] == [1.0, 1.0]
    assert results[1]["every"] == results[2]["every"] == [[1.0, 1.0], [2.0, 2.0]]
    assert results[1]["grad"] == results[2]["grad"] == [5.0, 5.0]
