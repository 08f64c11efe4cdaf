"""PipelineCommunicator on real gloo processes (one spawn of 4 ranks runs every check)."""

from __future__ import annotations

import time

import pytest
import torch

from megastrategy.pipeline.p2p import PipelineCommunicator
from tests.helpers.dist import run_distributed

_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float64, torch.float16, torch.int8]
_SHAPES = [(3,), (2, 5), (0, 4), (), (1, 2, 3, 4), (7,), (2, 3, 1)]


def make(stage: int, i: int, kind: str) -> torch.Tensor:
    """A tensor that identifies (sender stage, index, direction) by shape, dtype and values."""
    shape = _SHAPES[i % len(_SHAPES)]
    dtype = _DTYPES[(i + stage) % len(_DTYPES)]
    numel = 1
    for d in shape:
        numel *= d
    offset = 1 if kind == "f" else 2
    values = (torch.arange(numel, dtype=torch.int64) + 7 * stage + 3 * i + 11 * offset) % 50
    if dtype == torch.bool:
        values = values % 2
    return values.to(dtype).reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def ring_checks(comm: PipelineCommunicator, stage: int, pp: int) -> dict:
    nxt, prv = (stage + 1) % pp, (stage - 1) % pp
    n = len(_SHAPES)
    # every message of both directions in flight before any receive; receive gradients first
    for i in range(n):
        comm.send_forward(make(stage, i, "f"), microbatch=i)
        comm.send_backward(make(stage, i, "b"), microbatch=i)
    for i in range(n):
        assert same(comm.recv_backward(expect_microbatch=i), make(nxt, i, "b")), (stage, i)
    for i in range(n):
        got = comm.recv_forward(expect_shape=_SHAPES[i], expect_dtype=make(prv, i, "f").dtype, expect_microbatch=i)
        assert same(got, make(prv, i, "f")), (stage, i)
    # fused pairs
    comm.send_backward(make(stage, 20, "b"))
    assert same(comm.send_forward_recv_backward(make(stage, 21, "f")), make(nxt, 20, "b"))
    assert same(comm.recv_forward(), make(prv, 21, "f"))
    comm.send_forward(make(stage, 22, "f"))
    assert same(comm.send_backward_recv_forward(make(stage, 23, "b")), make(prv, 22, "f"))
    assert same(comm.recv_backward(), make(nxt, 23, "b"))
    assert same(comm.send_forward_recv_forward(make(stage, 24, "f")), make(prv, 24, "f"))
    assert same(comm.send_backward_recv_backward(make(stage, 25, "b")), make(nxt, 25, "b"))
    # a handle waited out of order completes the earlier one first (results kept)
    comm.send_forward(make(stage, 26, "f"))
    comm.send_forward(make(stage, 27, "f"))
    h1, h2 = comm.irecv_forward(), comm.irecv_forward()
    assert same(h2.wait(), make(prv, 27, "f")) and same(h1.wait(), make(prv, 26, "f"))
    comm.wait_all()
    assert comm.pending_sends == 0
    return dict(comm.stats)


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    # every group, in the same order on every rank
    g4 = dist.new_group([0, 1, 2, 3])
    g3 = dist.new_group([0, 1, 2])
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # tp2 x pp2: stage 0 = ranks 0,1
    ppg = [dist.new_group([0, 2]), dist.new_group([1, 3])]

    # ---- rings of 4, 3 (rank 3 idle) and 2 (two independent pairs; prev == next) ----
    t0 = time.perf_counter()
    comm = PipelineCommunicator(pp_group=g4, pp_ranks=[0, 1, 2, 3], pp_rank=rank, device="cpu")
    out["stats4"] = ring_checks(comm, rank, 4)
    if rank < 3:
        comm = PipelineCommunicator(pp_group=g3, pp_ranks=[0, 1, 2], pp_rank=rank, device="cpu")
        ring_checks(comm, rank, 3)
    pair = [0, 1] if rank < 2 else [2, 3]
    comm2 = PipelineCommunicator(pp_group=g2[rank // 2], pp_ranks=pair, pp_rank=rank % 2, device="cpu")
    assert comm2.prev_rank == comm2.next_rank
    ring_checks(comm2, rank % 2, 2)
    out["ring_s"] = time.perf_counter() - t0

    # ---- shape / dtype mismatch: a clear error, and the stream stays in step ----
    stage = rank % 2
    if stage == 0:
        comm2.send_forward(torch.ones(2, 3))
        comm2.send_forward(torch.ones(2, 3))
        comm2.send_forward(torch.full((5,), 4.0))
    else:
        with pytest.raises(RuntimeError) as err:
            comm2.recv_forward(expect_shape=(2, 4))
        out["shape_msg"] = str(err.value)
        with pytest.raises(RuntimeError) as err:
            comm2.recv_forward(expect_dtype=torch.float64)
        out["dtype_msg"] = str(err.value)
        assert same(comm2.recv_forward(expect_shape=(5,)), torch.full((5,), 4.0))
    comm2.wait_all()

    # ---- scatter-gather over tp2 x pp2 equals a plain send, with half the bytes ----
    tp_rank, pp_stage = rank % 2, rank // 2
    pp_ranks = [tp_rank, tp_rank + 2]
    sg = PipelineCommunicator(pp_group=ppg[tp_rank], pp_ranks=pp_ranks, pp_rank=pp_stage, device="cpu", tp_group=tp[pp_stage])
    plain = PipelineCommunicator(
        pp_group=ppg[tp_rank], pp_ranks=pp_ranks, pp_rank=pp_stage, device="cpu", tp_group=tp[pp_stage],
        scatter_gather=False,
    )
    gen = torch.Generator().manual_seed(5)
    act = torch.randn(4, 3, 6, generator=gen)  # same on both TP ranks; numel 72, divisible by 2
    odd = torch.randn(3, 5, generator=gen, dtype=torch.float64)  # numel 15: falls back to a full send
    grad = torch.randn(4, 3, 6, generator=gen).to(torch.bfloat16)
    for comm_ in (sg, plain):
        if pp_stage == 0:
            comm_.send_forward(act, microbatch=0)
            comm_.send_forward(odd, microbatch=1)
            assert same(comm_.recv_backward(expect_microbatch=0), grad)
            comm_.send_forward(act)  # the receiver expects another shape
            comm_.send_forward(odd)
        else:
            assert same(comm_.recv_forward(expect_microbatch=0), act)
            assert same(comm_.recv_forward(expect_microbatch=1), odd)
            comm_.send_backward(grad, microbatch=0)
            with pytest.raises(RuntimeError, match=r"expected shape \(4, 3, 7\)"):
                comm_.recv_forward(expect_shape=(4, 3, 7))
            assert same(comm_.recv_forward(), odd)
        comm_.wait_all()
    out["sg_stats"], out["plain_stats"] = dict(sg.stats), dict(plain.stats)

    # ---- a receive that never arrives times out with the peer named ----
    if rank == 1:
        lonely = PipelineCommunicator(pp_group=g2[0], pp_ranks=[0, 1], pp_rank=1, device="cpu", timeout=0.5)
        with pytest.raises(RuntimeError) as err:
            lonely.recv_forward()
        out["timeout_msg"] = str(err.value)
    dist.barrier()
    return out


def test_p2p_on_four_ranks():
    results = run_distributed(_worker, 4, timeout=90)
    # ring of 4: each rank sent the same set of messages
    stats = results[0]["stats4"]
    n_msgs = 2 * len(_SHAPES) + 8
    assert stats["messages"] == n_msgs
    assert stats["bytes"] > 0 and stats["scatter_gather"] == 0

    shape_msg, dtype_msg = results[1]["shape_msg"], results[1]["dtype_msg"]
    assert "rank 0" in shape_msg and "expected shape (2, 4)" in shape_msg and "received shape (2, 3)" in shape_msg
    assert "expected" in dtype_msg and "torch.float64" in dtype_msg and "torch.float32" in dtype_msg
    assert "rank 2" in results[3]["shape_msg"]

    for r in (0, 1):  # senders of the activations (stage 0)
        sg, plain = results[r]["sg_stats"], results[r]["plain_stats"]
        assert sg["scatter_gather"] == 2 and plain["scatter_gather"] == 0
        act, odd = 72 * 4, 15 * 8
        assert plain["bytes"] == 2 * (act + odd)
        assert sg["bytes"] == 2 * (act // 2 + odd)  # activations as halves, the odd tensor in full
    for r in (2, 3):  # gradient senders
        assert results[r]["sg_stats"]["bytes"] * 2 == results[r]["plain_stats"]["bytes"] == 72 * 2

    assert "rank 0" in results[1]["timeout_msg"] and "activation" in results[1]["timeout_msg"]


def test_loopback_single_stage():
    """pp_size == 1: the rank is its own neighbour; no process group is needed."""
    comm = PipelineCommunicator(pp_group=None, pp_ranks=[0], pp_rank=0, device="cpu")
    comm.send_forward(make(0, 1, "f"))
    comm.send_backward(make(0, 4, "b"))
    h = comm.irecv_forward()  # posted before anything else is sent: copied when waited on
    comm.send_forward(make(0, 2, "f"))
    assert same(comm.recv_backward(), make(0, 4, "b"))
    assert same(h.wait(), make(0, 1, "f"))
    assert same(comm.recv_forward(), make(0, 2, "f"))
    with pytest.raises(RuntimeError, match="receives before it sends"):
        comm.recv_forward()


def test_bad_arguments():
    with pytest.raises(ValueError, match="pp_rank"):
        PipelineCommunicator(pp_group=None, pp_ranks=[0, 1], pp_rank=2, device="cpu")
    comm = PipelineCommunicator(pp_group=None, pp_ranks=[0], pp_rank=0, device="cpu")
    with pytest.raises(ValueError, match="at most"):
        comm.send_forward(torch.zeros([1] * 11))
    with pytest.raises(TypeError):
        comm.send_forward([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "backend, device, wire",
    [("gloo", "cuda", "cpu"), ("nccl", "cuda", "cuda"), ("cpu:gloo,cuda:nccl", "cuda", "cuda"),
     ("gloo", "cpu", "cpu"), ("nccl", "cpu", "cpu")],
)
def test_messages_go_through_host_memory_only_where_gloo_must_carry_cuda_tensors(monkeypatch, backend, device, wire):
    """gloo has no point-to-point for CUDA tensors: several ranks sharing one GPU stage through the CPU."""
    import torch.distributed as dist

    from megastrategy.pipeline.p2p import wire_device

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert wire_device(None, torch.device(device)) == torch.device(wire)
