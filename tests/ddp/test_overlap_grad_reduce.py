"""overlap_grad_reduce: buckets start reducing during the last microbatch's backward.

Two identical models on each of 2 real processes, one buffer synchronous and one overlapped,
see the same microbatches; the reduced gradients must be bit-identical, and the overlapped
buffer's reductions must have started (from the backward hooks) before ``reduce()`` is called.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from megastrategy.ddp.grad_buffer import GradientBuffer
from tests.helpers.dist import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(model, rank, step, micro):
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return model(torch.randn(3, 4, generator=g)).pow(2).sum()


def _valid(buf):
    """What reduce() guarantees: the whole buffer, or this rank's shard of every bucket."""
    return torch.cat([buf.shard_of(b) for b in buf.buckets]).clone()


def _compare(rank, world, distributed_optimizer):
    sync_model, overlap_model = _model(), _model()
    kw = dict(group=dist.group.WORLD, bucket_numel=30, distributed_optimizer=distributed_optimizer)
    sync = GradientBuffer(sync_model.parameters(), **kw)
    overlap = GradientBuffer(overlap_model.parameters(), overlap_grad_reduce=True, **kw)
    out = {"buckets": len(overlap.buckets), "identical": [], "early": [], "early_before_reduce": []}
    for step in range(2):  # twice: the per-step counters must reset
        for micro in range(2):
            _loss(sync_model, rank, step, micro).backward()
        _loss(overlap_model, rank, step, 0).backward()  # not the last microbatch: nothing starts
        out["early"].append(overlap.num_early_starts)
        with overlap.last_microbatch():
            _loss(overlap_model, rank, step, 1).backward()
        out["early_before_reduce"].append(sum(b.started_early for b in overlap.buckets))
        sync.reduce()
        overlap.reduce()
        out["identical"].append(torch.equal(_valid(sync), _valid(overlap)))
        sync.zero()
        overlap.zero()
    out["total_early"] = overlap.num_early_starts
    # reduce-scatter (or its fallback) gives this rank's part of the all-reduced mean
    if distributed_optimizer:
        ar_model = _model()
        ar = GradientBuffer(ar_model.parameters(), group=dist.group.WORLD, bucket_numel=30)
        dm = _model()
        do = GradientBuffer(dm.parameters(), **kw)
        for model in (ar_model, dm):
            _loss(model, rank, 5, 0).backward()
        ar.reduce()
        do.reduce()
        out["rs_matches_ar"] = all(torch.equal(p.main_grad.view(-1)[lo:hi], q.main_grad.view(-1)[lo:hi])
                                   for p, q, (lo, hi) in _owned(ar_model, dm, do))
    return out


def _owned(ar_model, dm, do):
    """(param in the all-reduce model, same param in the sharded model, owned [lo, hi) of it)."""
    for p, q in zip(ar_model.parameters(), dm.parameters()):
        bucket = do.bucket_of(q)
        start, end = bucket.ranges[id(q)]
        s0, s1 = do.shard_range(bucket)
        lo, hi = max(start, s0), min(end, s1)
        if lo < hi:
            yield p, q, (lo - start, hi - start)


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_overlapped_reduction_is_bit_identical_and_starts_in_backward(distributed_optimizer):
    for res in run_distributed(_compare, 2, distributed_optimizer, timeout=180):
        assert res["buckets"] > 1
        assert all(res["identical"]), res
        assert res["early"] == [0, res["buckets"]], "only the last microbatch's backward may start reductions"
        assert res["early_before_reduce"] == [res["buckets"]] * 2, res
        assert res["total_early"] == 2 * res["buckets"]
        if distributed_optimizer:
            assert res["rs_matches_ar"]


def _pipeline_and_guards(rank, world):
    out = {}
    # pipeline-like: every microbatch's backward runs inside one "last microbatch" region
    ref_model, model = _model(), _model()
    ref = GradientBuffer(ref_model.parameters(), group=dist.group.WORLD, bucket_numel=30)
    buf = GradientBuffer(model.parameters(), group=dist.group.WORLD, bucket_numel=30, overlap_grad_reduce=True)
    for micro in range(3):
        _loss(ref_model, rank, 0, micro).backward()
    with buf.last_microbatch(backward_passes=3):
        _loss(model, rank, 0, 0).backward()
        _loss(model, rank, 0, 1).backward()
        out["started_after_2_of_3"] = buf.num_early_starts
        _loss(model, rank, 0, 2).backward()
    out["started_after_3"] = buf.num_early_starts
    ref.reduce()
    buf.reduce()
    out["pipeline_identical"] = torch.equal(ref.buffers[torch.float32], buf.buffers[torch.float32])
    buf.zero()
    # a deferred parameter's bucket waits for reduce() (its gradient changes after backward)
    last = list(model.parameters())[-1]
    dbuf_model = _model()
    dlast = list(dbuf_model.parameters())[-1]
    dbuf = GradientBuffer(dbuf_model.parameters(), group=dist.group.WORLD, bucket_numel=30,
                          overlap_grad_reduce=True, deferred_params=[dlast])
    with dbuf.last_microbatch():
        _loss(dbuf_model, rank, 0, 0).backward()
    out["deferred_started"] = dbuf.bucket_of(dlast).started
    out["others_started"] = sum(b.started for b in dbuf.buckets)
    dlast.main_grad.add_(1.0)  # e.g. the tied-embedding sum, after backward and before reduce()
    dbuf.reduce()
    out["deferred_reduced"] = float(dlast.main_grad.view(-1)[0])
    # more backward passes than announced: an error, not a silently wrong gradient
    with buf.last_microbatch():
        _loss(model, rank, 1, 0).backward()
        try:
            _loss(model, rank, 1, 1).backward()
            out["double"] = "no error"
        except RuntimeError as err:
            out["double"] = str(err)
    buf.zero()
    del last
    return out


def test_backward_passes_deferred_buckets_and_guard():
    res = run_distributed(_pipeline_and_guards, 2, timeout=180)
    for r in res:
        assert r["started_after_2_of_3"] == 0 and r["started_after_3"] > 0
        assert r["pipeline_identical"]
        assert r["deferred_started"] is False and r["others_started"] >= 1
        assert "after the reduction of its bucket" in r["double"]
    # deferred bucket reduced after the extra +1 on each rank: the mean includes it
    assert res[0]["deferred_reduced"] == res[1]["deferred_reduced"]
