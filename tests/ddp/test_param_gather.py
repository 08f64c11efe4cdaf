"""overlap_param_gather: the ZeRO-1 all-gather finishes in the next forward, with the same values.

Two identical models on each of 2 real processes, one distributed optimizer gathering
synchronously and one in the background; after every step the background one's parameters are
stale (other ranks' shards) until a forward's pre-hooks or ``wait_for_param_gather`` finish the
gathers, and then they are bit-identical to the synchronous one's.
"""
import torch
import torch.distributed as dist
from torch import nn

from megastrategy.ddp.distributed_optimizer import DistributedOptimizer
from megastrategy.ddp.grad_buffer import GradientBuffer
from tests.helpers.dist import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return model(torch.randn(3, 4, generator=g)).pow(2).sum()


def _setup(overlap: bool):
    model = _model()
    buf = GradientBuffer(model.parameters(), group=dist.group.WORLD, bucket_numel=30, distributed_optimizer=True)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), buf)
    if overlap:
        opt.enable_overlap_param_gather(model)
    return model, buf, opt


def _compare(rank, world):
    out = {"losses_equal": [], "params_equal_after": [], "stale_before": [], "pending": []}
    runs = [_setup(False), _setup(True)]
    for step in range(3):
        losses = []
        for model, buf, opt in runs:
            loss = _loss(model, rank, step)  # the overlapped model's forward finishes its gathers
            loss.backward()
            buf.reduce()
            opt.step()
            buf.zero()
            losses.append(float(loss))
        out["losses_equal"].append(losses[0] == losses[1])
        (sync, _, _), (over, _, over_opt) = runs
        out["pending"].append(len(over_opt.param_gather.pending))
        out["stale_before"].append(not all(torch.equal(a, b) for a, b in zip(sync.parameters(), over.parameters())))
        if step == 2:
            over_opt.wait_for_param_gather()  # what checkpoints and evaluation call
        else:
            with torch.no_grad():
                over(torch.zeros(1, 4))  # pre-hooks finish every bucket before its layer runs
        out["params_equal_after"].append(all(torch.equal(a, b) for a, b in zip(sync.parameters(), over.parameters())))
    out["waited_in_forward"] = runs[1][2].param_gather.num_waited_in_forward
    out["buckets"] = len(runs[1][1].buckets)
    return out


def test_background_gather_is_finished_by_forward_hooks_and_bit_identical():
    for res in run_distributed(_compare, 2, timeout=180):
        assert res["buckets"] > 1
        assert all(res["losses_equal"]), res
        assert all(res["params_equal_after"]), res
        assert all(p == res["buckets"] for p in res["pending"]), "every bucket's gather runs in the background"
        assert all(res["stale_before"]), "parameters were gathered synchronously"
        assert res["waited_in_forward"] >= 2 * res["buckets"]
