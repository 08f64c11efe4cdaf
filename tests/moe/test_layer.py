"""MoELayer sharded over real gloo processes equals the one-device layer: outputs, input
gradients, and every parameter gradient after the dense / expert gradient buffers' reductions
(the auxiliary losses' injected gradient included), plus the global gradient norm.

Each configuration builds the one-device layer from one seed on every rank, runs it on every
data-parallel replica's tokens (the reference: DDP's average of the replicas' losses), then
shards a copy with ``shard_moe_layers`` and runs this rank's replica. The rank-group layout of
MoE folding (world 8, tp=2, etp=1, ep=4) is pinned in
``tests/test_parallel_state.py::test_moe_folding_world8_tp2_etp1_ep4``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.dist import run_distributed

H, FFN, E, K = 8, 12, 4, 2
B, S = 3, 7  # 21 tokens per replica: splits unevenly over tp=2


def _layer(**kw):
    from megastrategy.moe import MoELayer

    torch.manual_seed(0)
    return MoELayer(H, FFN, E, top_k=K, **kw).double()


def _data(dp: int):
    g = torch.Generator().manual_seed(42)
    X = torch.randn(dp, B, S, H, generator=g, dtype=torch.float64)
    G = torch.randn(dp, B, S, H, generator=g, dtype=torch.float64)
    return X, G


def _maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _full_slice(full: torch.Tensor, info) -> torch.Tensor:
    if info.etp_dim is None or info.etp_size == 1:
        return full
    size = full.size(info.etp_dim) // info.etp_size
    return full.narrow(info.etp_dim, info.etp_rank * size, size)


def _check_layer(rank, world, tp=1, ep=1, etp=1, **layer_kw):
    from megastrategy.ddp.grad_buffer import GradientBuffer
    from megastrategy.moe import integration as I
    from megastrategy.moe.experts import get_expert_info
    from megastrategy.parallel_state import ParallelLayout, ParallelState

    layout = ParallelLayout(world_size=world, tp=tp, ep=ep, etp=etp)
    ps = ParallelState(layout, rank)
    try:
        ref = _layer(**layer_kw)
        layer = copy.deepcopy(ref)
        X, G = _data(layout.dp)

        # reference: every replica on one device, gradients of the mean of the replicas' losses
        ref_y, ref_xg = [], []
        ref.aux_loss_scale = 1.0 / layout.dp  # the aux gradient is scaled like the loss it joins
        for r in range(layout.dp):
            x = X[r].clone().requires_grad_(True)
            y = ref(x)
            ((y * G[r]).sum() / layout.dp).backward()
            ref_y.append(y.detach())
            ref_xg.append(x.grad * layout.dp)  # the activation gradient of replica r's own loss
        ref_grads = dict(ref.named_parameters())
        ref_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters()))

        total = I.shard_moe_layers(layer, ps)
        assert total == world, total
        local_experts = sorted(int(k) for k in layer.experts.keys())
        assert local_experts == list(range(ps.ep_rank * E // ep, (ps.ep_rank + 1) * E // ep))
        # fp64 end to end (the default fp32 buffers would round the fp64 gradients)
        dense = GradientBuffer(I.dense_parameters(layer), group=ps.dp_group, grad_reduce_in_fp32=False)
        experts = I.make_expert_grad_buffer(layer, ps, grad_reduce_in_fp32=False)
        assert {id(p) for p in experts.params} | {id(p) for p in dense.params} == {id(p) for p in layer.parameters()}

        x = X[ps.dp_rank].clone().requires_grad_(True)
        y = layer(x)
        (y * G[ps.dp_rank]).sum().backward()
        dense.reduce()
        experts.reduce()
        dense.expose_grads()
        experts.expose_grads()

        diffs = {"out": _maxdiff(y, ref_y[ps.dp_rank]), "x.grad": _maxdiff(x.grad, ref_xg[ps.dp_rank])}
        for name, p in layer.named_parameters():
            full = ref_grads[name].grad
            info = get_expert_info(p)
            want = _full_slice(full, info) if info is not None else full
            diffs[name] = _maxdiff(p.grad, want)
        norm = I.clip_grad_norm_with_experts(
            list(layer.parameters()), 1e9, parallel_state=ps, dense_counts_here=lambda p: ps.tp_rank == 0
        )
        # norms accumulate in fp32 (as for dense parameters): relative error
        diffs["grad-norm/1e4"] = abs(norm.item() / ref_norm.item() - 1) * 1e-4
        # the recorded load-balancing loss is this replica's, as on one device
        ref_aux = _layer(**layer_kw).train()
        ref_aux.load_state_dict(ref.state_dict())
        ref_aux(X[ps.dp_rank])
        diffs["aux-recorded"] = abs(layer.pop_recorded().item() - ref_aux.pop_recorded().item())
        return diffs
    finally:
        ps.destroy()


def _collect_without_moe_on_some_ranks(rank, world):
    """collect_aux_losses over a group where only rank 0 has MoE layers: nobody hangs, all agree."""
    import torch.distributed as dist
    from torch import nn

    from megastrategy.moe import MoELayer
    from megastrategy.moe.integration import collect_aux_losses

    torch.manual_seed(0)
    if rank == 0:
        model = nn.Sequential(MoELayer(H, FFN, E), MoELayer(H, FFN, E))
        model(torch.randn(10, H))
        want = sum(m._recorded["aux"][0].item() for m in model) / 2
    else:
        model, want = nn.Linear(2, 2), None
    got = collect_aux_losses(model, group=dist.group.WORLD)
    again = collect_aux_losses(model, group=dist.group.WORLD)  # records were cleared
    return {"got": float(got), "want": want, "again": again}


def _worker(rank, world, configs):
    results = {name: _check_layer(rank, world, **cfg) for name, cfg in configs.items()}
    if world == 2:
        c = _collect_without_moe_on_some_ranks(rank, world)
        results["collect"] = {"cleared": 0.0 if c["again"] is None else 1.0, "value": c["got"], "want": c["want"]}
    return results


CONFIGS_2 = {
    "ep2": dict(ep=2),
    "ep2-capacity1.0": dict(ep=2, capacity_factor=1.0),
    "ep2-allgather": dict(ep=2, dispatcher="allgather"),
    "ep2-sigmoid-zloss-nobias": dict(ep=2, score="sigmoid", z_loss_coeff=1e-2, bias=False),
    "tp2-ep2-etp1": dict(tp=2, ep=2, etp=1),
    "tp2-etp2": dict(tp=2, etp=2),
    "etp2-dp2": dict(etp=2),
}
CONFIGS_4 = {
    "ep4": dict(ep=4),
    "ep4-capacity0.5-allgather": dict(ep=4, capacity_factor=0.5, dispatcher="allgather"),
    "ep2-edp2": dict(ep=2),
    "ep2-etp2": dict(ep=2, etp=2),
    "ep2-etp2-allgather": dict(ep=2, etp=2, dispatcher="allgather"),
    "tp2-ep2-etp1": dict(tp=2, ep=2, etp=1),
    "tp2-ep2-etp2": dict(tp=2, ep=2, etp=2),
}
TOL = 1e-10


@pytest.mark.parametrize("world, configs", [(2, CONFIGS_2), (4, CONFIGS_4)], ids=["world2", "world4"])
def test_sharded_layer_matches_one_device(world, configs):
    results = run_distributed(_worker, world, configs, timeout=300)
    if world == 2:  # both ranks see rank 0's mean over its two layers; rank 1 has none
        collected = [r.pop("collect") for r in results]
        assert collected[0]["value"] == collected[1]["value"] == pytest.approx(collected[0]["want"], rel=1e-6)
        assert all(c["cleared"] == 0.0 for c in collected)
    bad = []
    for rank, per_cfg in enumerate(results):
        for cfg, diffs in per_cfg.items():
            for what, d in diffs.items():
                if not d <= TOL:
                    bad.append(f"{cfg} rank {rank} {what}: {d:.3g}")
    assert not bad, "\n".join(bad)
