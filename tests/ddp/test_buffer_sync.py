"""DDP's ``broadcast_buffers`` rule on 2 real processes: the first replica's buffers (every dtype),
broadcast when due, not after an accumulation step or an evaluation forward. The launches that
compare a BatchNorm conv net's buffers and validation loss with DDPStrategy at dp2 are in
tests/test_user_habits_round3.py."""
import torch
from torch import nn

from megastrategy.ddp.buffer_sync import BufferSync
from tests.helpers.dist import run_distributed


def _sync(rank, world_size):
    import torch.distributed as dist

    bn = nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.running_mean.fill_(float(rank + 1))
    bn.num_batches_tracked.fill_(rank + 5)
    sync = BufferSync(dist.group.WORLD, [0, 1])
    sync.before_step(bn)  # the first step: due
    first = (bn.running_mean.tolist(), int(bn.num_batches_tracked))
    sync.after_step(False)  # an accumulation step or an evaluation forward
    with torch.no_grad():
        bn.running_mean.fill_(float(rank + 10))
    sync.before_step(bn)
    kept = bn.running_mean.tolist()
    sync.after_step(True)
    sync.before_step(bn)
    return first, kept, bn.running_mean.tolist()


def test_buffers_follow_the_first_replica_when_due():
    results = run_distributed(_sync, 2)
    for rank, (first, kept, last) in enumerate(results):
        assert first == ([1.0] * 3, 5)
        assert kept == [float(rank + 10)] * 3
        assert last == [10.0] * 3


def test_one_replica_or_disabled_does_nothing():
    bn = nn.BatchNorm1d(2)
    BufferSync(None, [0]).before_step(bn)
    assert not BufferSync(object(), [0, 1], enabled=False).enabled


def test_buffers_of_modules_holding_experts_stay_each_ranks_own():
    from megastrategy.ddp.buffer_sync import _replicated_buffers
    from megastrategy.moe.experts import EXPERT_ATTR, ExpertParamInfo

    model = nn.Sequential(nn.BatchNorm1d(2), nn.BatchNorm1d(3))
    setattr(model[1].weight, EXPERT_ATTR, ExpertParamInfo(expert=0, name="w1", etp_dim=None))
    assert {b.numel() for b in _replicated_buffers(model)} == {2, 1}  # model[0]'s mean, var, count
