"""Dispatchers on real gloo processes: dispatch followed by combine returns the input with
identity experts (ep=2, ep=4, ep=2 x etp=2; all-to-all, its point-to-point fallback, and
all-gather), every local expert receives exactly the tokens routed to it from every rank, the
gradients are the conjugate exchange, and the all-to-all moves the minimum number of bytes.
One spawn per world size."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed

H, E, K = 5, 8, 2


def _tokens(rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(n, K, generator=g, dtype=torch.float64)
    return x, idx, w / w.sum(-1, keepdim=True)


def _n_tokens(rank: int) -> int:
    return [7, 3, 0, 11][rank % 4]  # uneven, one rank with no tokens at all


def _round_trip(rank, world, ep, etp, kind, fallback):
    from megastrategy.layers.mappings import record_collectives
    from megastrategy.moe import dispatcher as D
    from megastrategy.parallel_state import ParallelLayout, ParallelState

    ps = ParallelState(ParallelLayout(world_size=world, ep=ep, etp=etp), rank)
    D._A2A_FALLBACK["active"] = fallback
    try:
        d = D.make_dispatcher(kind, E, ps.ep_group, ps.expert_tp_group)
        x0, idx, w0 = _tokens(rank, _n_tokens(rank))
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with record_collectives() as log:
            rows, counts, state = d.dispatch(x, idx, w)
            # identity experts: with etp > 1 each expert-TP rank contributes 1/etp of the output
            y = d.combine(rows / etp, state)
        out = {"fwd": (y - x0).abs().max().item() if y.numel() else 0.0}

        # a local expert receives every assignment to it from the EP groups of all its expert-TP peers
        ep_groups = ps.layout.expert_generator().get_ranks("ep")
        members = sorted({q for peer in ps.expert_tp_ranks for grp in ep_groups if peer in grp for q in grp})
        want = []
        for e in range(d.local_expert_offset, d.local_expert_offset + d.num_local_experts):
            want.append(sorted(
                tuple(xr[i].tolist()) for q in members for xr, ir in [_tokens(q, _n_tokens(q))[:2]]
                for i in range(ir.size(0)) if e in ir[i].tolist()
            ))
        got, start = [], 0
        for c in counts:
            got.append(sorted(tuple(t.tolist()) for t in rows[start : start + c].detach()))
            start += c
        out["routed"] = got == want

        g = torch.Generator().manual_seed(7 + rank)
        gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
        (y * gy).sum().backward()
        out["x.grad"] = (x.grad - gy).abs().max().item() if x.numel() else 0.0  # sum_j w_j = 1
        want_wg = (gy * x0).sum(-1, keepdim=True).expand_as(w0)
        out["w.grad"] = (w.grad - want_wg).abs().max().item() if w.numel() else 0.0
        out["a2a_bytes_fwd"] = sum(r.bytes for r in log if r.op == "all_to_all")
        out["min_bytes_fwd"] = 2 * x0.size(0) * K * H * 8  # each routed token once each way
        return out
    finally:
        D._A2A_FALLBACK["active"] = False
        ps.destroy()


def _raw_collectives(rank, world):
    """gather_v / reduce_scatter_v / split/gather tokens are conjugate and handle empty shares."""
    import torch.distributed as dist

    from megastrategy.moe import dispatcher as D

    group = dist.new_group(list(range(world)))
    sizes = [_n_tokens(r) for r in range(world)]
    xs = [_tokens(r, sizes[r])[0] for r in range(world)]
    x = xs[rank].clone().requires_grad_(True)
    gathered = D.gather_v(x, sizes, group)
    ok = torch.equal(gathered, torch.cat(xs))
    gys = [torch.randn(sum(sizes), H, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(world)]
    (gathered * gys[rank]).sum().backward()
    start = sum(sizes[:rank])
    ok &= torch.allclose(x.grad, sum(gys)[start : start + sizes[rank]])
    full = torch.cat(xs)
    mine = D.split_tokens(full, group)
    split = D.token_split_sizes(full.size(0), world)
    ok &= torch.equal(mine, full[sum(split[:rank]) : sum(split[: rank + 1])])
    ok &= torch.equal(D.gather_tokens(mine, full.size(0), group), full)
    return bool(ok)


def _worker(rank, world, cases):
    results = {name: _round_trip(rank, world, *case) for name, case in cases.items()}
    results["raw"] = _raw_collectives(rank, world)
    return results


CASES = {
    2: {
        "ep2-alltoall": (2, 1, "alltoall", False),
        "ep2-alltoall-p2p-fallback": (2, 1, "alltoall", True),
        "ep2-allgather": (2, 1, "allgather", False),
        "etp2-alltoall": (1, 2, "alltoall", False),
    },
    4: {
        "ep4-alltoall": (4, 1, "alltoall", False),
        "ep4-alltoall-p2p-fallback": (4, 1, "alltoall", True),
        "ep4-allgather": (4, 1, "allgather", False),
        "ep2-etp2-alltoall": (2, 2, "alltoall", False),
        "ep2-etp2-allgather": (2, 2, "allgather", False),
    },
}


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_round_trip_on_processes(world):
    results = run_distributed(_worker, world, CASES[world], timeout=240)
    bad = []
    for rank, res in enumerate(results):
        assert res.pop("raw"), f"rank {rank}: gather_v/reduce_scatter_v/split/gather tokens"
        for name, r in res.items():
            for key in ("fwd", "x.grad", "w.grad"):
                if not r[key] < 1e-12:
                    bad.append(f"{name} rank {rank} {key}: {r[key]:.3g}")
            if not r["routed"]:
                bad.append(f"{name} rank {rank}: local experts did not receive exactly their tokens")
    for name, (ep, _, kind, _) in CASES[world].items():
        if kind != "alltoall":
            continue
        # each rank records what it sends: its routed tokens (dispatch) and the rows it received
        # (combine); over the world that is exactly every routed token once each way
        sent = sum(res[name]["a2a_bytes_fwd"] for res in results)
        minimum = sum(res[name]["min_bytes_fwd"] for res in results) if ep > 1 else 0
        if sent != minimum:
            bad.append(f"{name}: all-to-all moved {sent} bytes, the minimum is {minimum}")
    assert not bad, "\n".join(bad)
