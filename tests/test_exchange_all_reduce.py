"""The point-to-point all-reduce equals gloo's own on real processes, leaves every rank with the
same bits, and does not take messages meant for other point-to-point traffic on the group."""
import pytest
import torch
import torch.distributed as dist

from megastrategy.exchange_all_reduce import SMALL_BYTES, exchange_all_reduce, exchange_applies
from megastrategy.layers import mappings as M
from tests.helpers.dist import run_distributed


def _value(rank, dtype, n=1000):
    return torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float32).to(dtype)


def _same_on_every_rank(t, group):
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return all(torch.equal(p.view(torch.uint8), parts[0].view(torch.uint8)) for p in parts)


def _check_against_gloo(rank, world):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    failures = []
    for size, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
        for op, ref_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            for dtype in (torch.float32, torch.bfloat16):
                ours, ref = _value(rank, dtype), _value(rank, dtype)
                assert exchange_applies(ours, group, size, op)
                kept = _value(rank, dtype)
                fresh = exchange_all_reduce(kept, group, size, op, in_place=False)
                exchange_all_reduce(ours, group, size, op)
                if not (torch.equal(kept, _value(rank, dtype)) and torch.equal(fresh, ours)):
                    failures.append(f"world {size} {op} {dtype}: in_place=False changed its input or its result")
                dist.all_reduce(ref, op=ref_op, group=group)
                tol = 1e-6 if dtype == torch.float32 else 1e-2
                exact = size == 2 or op != "sum"  # one add per element: the order cannot differ
                agrees = torch.equal(ours, ref) if exact else torch.allclose(ours.float(), ref.float(), rtol=tol, atol=tol)
                if not agrees:
                    failures.append(f"world {size} {op} {dtype}: differs from gloo's all_reduce")
                if not _same_on_every_rank(ours, group):
                    failures.append(f"world {size} {op} {dtype}: ranks disagree")
    return failures


def _check_pending_messages_untouched(rank, world):
    """A tag-0 message posted to the peer before the all-reduce is still there for its receive after."""
    peer = 1 - rank
    marker, got = torch.full((3,), 7.0 + rank), torch.empty(3)
    pending = dist.isend(marker, dst=peer)
    t = torch.full((5,), float(rank + 1))
    exchange_all_reduce(t, dist.group.WORLD, world)
    dist.recv(got, src=peer)
    pending.wait()
    return t.tolist(), got.tolist()


def _layers_use_the_exchange_on_a_pair(rank, world):
    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        y = M.reduce_from_tensor_parallel_region(torch.full((4,), float(rank)), dist.group.WORLD)
        big = torch.zeros(SMALL_BYTES // 4 + 1)
        M.all_reduce(big, dist.group.WORLD)
    finally:
        dist.all_reduce = original
    return y.tolist(), len(calls)


@pytest.mark.timeout(180)
def test_equals_gloo_and_every_rank_gets_the_same_bits():
    for failures in run_distributed(_check_against_gloo, 4):
        assert failures == []


@pytest.mark.timeout(120)
def test_does_not_consume_other_point_to_point_messages():
    results = run_distributed(_check_pending_messages_untouched, 2)
    assert results[0] == ([3.0] * 5, [8.0] * 3)
    assert results[1] == ([3.0] * 5, [7.0] * 3)


@pytest.mark.timeout(120)
def test_the_layers_take_it_on_a_gloo_pair():
    for y, calls in run_distributed(_layers_use_the_exchange_on_a_pair, 2):
        assert y == [1.0] * 4
        assert calls == 0  # a pair uses the exchange at any size


@pytest.mark.parametrize("tensor, world", [
    (torch.zeros(4, device="meta"), 2),  # not on the CPU: the backend's collective
    (torch.zeros(4), 3),  # not a power of two
    (torch.zeros(SMALL_BYTES // 4 + 1), 4),  # more than two ranks and over SMALL_BYTES: the ring moves fewer bytes
], ids=["not-cpu", "world-3", "world-4-large"])
def test_not_applied_where_it_would_be_wrong_or_slower(tensor, world):
    assert exchange_applies(tensor, None, world, "sum") is False
