"""The ZeRO-1 distributed optimizer on 2 real processes against a plain optimizer in one process.

The reference steps the user's optimizer on the averaged gradient (every rank's microbatches);
the distributed one steps shards of it on each rank and all-gathers. Both must give the same
parameters, the same global gradient norm and the same (whole) optimizer state.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from megastrategy.ddp.distributed_optimizer import DistributedOptimizer, merge_sharded_state_dicts
from megastrategy.ddp.grad_buffer import GradientBuffer
from tests.helpers.dist import run_distributed

STEPS, MICRO = 3, 2


def _model():
    # 51 parameters; buffer order (reversed) is b2[0:3] w2[3:21] b1[21:27] w1[27:51]. With one
    # bucket padded to 52 the shard boundary 26 cuts b1; with bucket_numel=20 the buckets
    # [b2 w2] (22 padded) and [b1 w1] (30) are cut inside w2 and inside w1.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _groups(model):
    return [
        {"params": list(model[0].parameters()), "lr": 1e-2, "weight_decay": 0.1},
        {"params": list(model[2].parameters()), "lr": 5e-2, "weight_decay": 0.0},
    ]


def _optimizer(kind, model):
    if kind == "adamw":
        return torch.optim.AdamW(_groups(model), lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)


def _loss(model, rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(5, 4, generator=g)
    return model(x).pow(2).sum()


def _schedule(opt):  # an LR scheduler made on the USER's optimizer, as configure_optimizers does
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)


def _reference(kind, world, clip, steps=STEPS, model=None, opt=None):
    """One process: the user's optimizer on the mean over ranks of each rank's summed grads."""
    model = model or _model()
    opt = opt or _optimizer(kind, model)
    sched = _schedule(opt)
    norms = []
    for step in range(steps):
        per_rank = []
        for r in range(world):
            opt.zero_grad()
            for micro in range(MICRO):
                _loss(model, r, step, micro).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(grads[i] / world for grads in per_rank)  # what the buffer computes
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
    return model, opt, norms


def _train_distributed(kind, bucket_numel, clip):
    model = _model()
    opt = _optimizer(kind, model)
    sched = _schedule(opt)
    buf = GradientBuffer(model.parameters(), group=dist.group.WORLD, distributed_optimizer=True, bucket_numel=bucket_numel)
    dopt = DistributedOptimizer(opt, buf)
    rank = dist.get_rank()
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            _loss(model, rank, step, micro).backward()
        buf.reduce()
        if clip is not None:
            norms.append(float(dopt.clip_grad_norm_(clip)))
        dopt.step()
        buf.zero()
        sched.step()
    return model, dopt, buf, norms


def _state_numel(dopt):
    return sum(v.numel() for s in dopt.shard_optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def _same_state(a, b):
    assert a["param_groups"] == b["param_groups"], (a["param_groups"], b["param_groups"])
    assert sorted(a["state"]) == sorted(b["state"])
    err = 0.0
    for i, values in b["state"].items():
        assert sorted(a["state"][i]) == sorted(values), (i, sorted(a["state"][i]), sorted(values))
        for k, v in values.items():
            if torch.is_tensor(v):
                assert a["state"][i][k].shape == v.shape, (i, k)
                err = max(err, float((a["state"][i][k].float() - v.float()).abs().max()))
            else:
                assert a["state"][i][k] == v
    return err


def _check(rank, world, kind):
    out = {}
    for bucket_numel in (10**6, 20):
        clip = 0.05 if kind == "sgd" else None
        model, dopt, buf, norms = _train_distributed(kind, bucket_numel, clip)
        ref, ref_opt, ref_norms = _reference(kind, world, clip)
        straddling = sum(
            1 for b in buf.buckets for p in b.params
            if b.ranges[id(p)][0] < buf.shard_range(b, 0)[1] < b.ranges[id(p)][1]
        )
        full_state = sum(v.numel() for s in ref_opt.state.values() for v in s.values() if v is not None and v.dim() > 0)
        owned = sum(piece.numel for piece in dopt._pieces)
        res = {
            "param_err": max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref.parameters())),
            "norm_err": max([abs(a - b) / b for a, b in zip(norms, ref_norms)], default=0.0),
            "clipped": [n > 0.05 for n in norms],
            "buckets": len(buf.buckets),
            "straddling": straddling,
            "state_numel": _state_numel(dopt),
            "full_state_numel": full_state,
            "owned": owned,
            "total_numel": sum(p.numel() for p in model.parameters()),
        }
        # state_dict: the whole torch-format state, equal to the reference optimizer's
        sd = dopt.state_dict()
        # the scheduler changed the user's optimizer's LR; the shard optimizer follows (synced
        # at every step and by state_dict)
        res["lr_inner"] = [g["lr"] for g in dopt.shard_optimizer.param_groups]
        res["lr_ref"] = [g["lr"] for g in ref_opt.param_groups]
        res["state_err"] = _same_state(sd, ref_opt.state_dict())
        # the sharded form + metadata reassembles to the same thing
        shards = [None] * world
        dist.all_gather_object(shards, dopt.sharded_state_dict())
        res["merged_err"] = _same_state(merge_sharded_state_dicts(shards), sd)
        # resharding: the reference's single-process state loads into a dp=2 distributed optimizer,
        # and one more step on both agrees
        model2 = _model()
        with torch.no_grad():
            for p, q in zip(model2.parameters(), ref.parameters()):
                p.copy_(q)
        opt2 = _optimizer(kind, model2)
        buf2 = GradientBuffer(model2.parameters(), group=dist.group.WORLD, distributed_optimizer=True, bucket_numel=bucket_numel)
        dopt2 = DistributedOptimizer(opt2, buf2)
        dopt2.load_state_dict(ref_opt.state_dict())
        res["reload_state_err"] = _same_state(dopt2.state_dict(), ref_opt.state_dict())
        for micro in range(MICRO):
            _loss(model2, rank, STEPS, micro).backward()
        buf2.reduce()
        if clip is not None:
            dopt2.clip_grad_norm_(clip)
        dopt2.step()
        ref_more = _model()
        ref_opt_more = _optimizer(kind, ref_more)
        _reference(kind, world, clip, steps=STEPS + 1, model=ref_more, opt=ref_opt_more)
        # the continued run used LambdaLR from scratch for STEPS+1 steps; dopt2's lr came from the state
        res["resume_err"] = max(float((a - b).detach().abs().max()) for a, b in zip(model2.parameters(), ref_more.parameters()))
        out[bucket_numel] = res
    return out


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_dp2_distributed_optimizer_matches_plain_optimizer(kind):
    results = run_distributed(_check, 2, kind, timeout=240)
    for bucket_numel in (10**6, 20):
        per_rank = [r[bucket_numel] for r in results]
        for res in per_rank:
            assert res["param_err"] < 1e-6, res
            assert res["norm_err"] < 1e-5, res
            assert res["state_err"] < 1e-6 and res["merged_err"] == 0.0, res
            assert res["reload_state_err"] == 0.0 and res["resume_err"] < 1e-6, res
            assert res["straddling"] >= 1, "the test must have a parameter cut by the shard boundary"
            assert res["lr_inner"] == res["lr_ref"], "the scheduler's LR did not reach the shard optimizer"
        if kind == "sgd":
            assert all(per_rank[0]["clipped"]), "clipping must be active in this test"
        if bucket_numel == 20:
            assert per_rank[0]["buckets"] == 2
        # each rank owns and keeps state for its half, and together they cover everything once
        total = per_rank[0]["total_numel"]
        assert sum(r["owned"] for r in per_rank) == total
        assert all(r["owned"] <= -(-total // 2) + 1 for r in per_rank)
        states = [r["state_numel"] for r in per_rank]
        full = per_rank[0]["full_state_numel"]
        assert sum(states) == full
        assert all(s <= full // 2 + 2 * len(per_rank) for s in states), (states, full)
