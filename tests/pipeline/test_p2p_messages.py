"""Pipeline p2p sends the schedule's minimum of messages after the first step (issue #16).

The minimum is one point-to-point message per tensor crossing a stage boundary: e.g. 1F1B
pp=2 with 4 microbatches, stage 0 sends 4 activations and receives 4 gradients, 8 messages.
Messages are counted twice: by the communicator's ``stats`` and by wrapping
``torch.distributed.batch_isend_irecv`` (every op posted on the wire). One spawn of 4 ranks
runs pp=4 and two independent pp=2 pipelines; results are checked against a serial model.
"""

from __future__ import annotations

import pytest
import torch

from megastrategy.pipeline.executor import PipelineExecutor
from megastrategy.pipeline.p2p import PipelineCommunicator
from megastrategy.pipeline.schedules import StepPart
from tests.helpers.dist import run_distributed
from tests.pipeline.test_executor import check_against_serial, pipeline_run

CONFIGS = [(2, 1, 4), (2, 1, 8), (4, 1, 4), (4, 1, 8)]  # (pp, vp, M), 1F1B
OTHER = [(2, 2, 4, "1f1b"), (2, 1, 4, "zb_h1")]  # interleaved and zero-bubble: the same minimum


def schedule_minimum(steps, pp: int, rank: int, vp: int) -> int:
    """One message per activation or gradient that crosses a boundary, as this rank's steps need."""
    last = pp * vp - 1
    count = 0
    for step in steps:
        stage = step[1] * pp + rank
        part = StepPart(step[3]) if len(step) > 3 else StepPart.WHOLE
        if not step[0] and part is StepPart.WEIGHT:
            continue
        count += (stage != 0) + (stage != last)  # receive from / send to the neighbours that exist
    return count


class WireCounter:
    """Counts the ops that reach ``dist.batch_isend_irecv`` (the communicator's only way out).
    Installed for good: it runs in a spawned worker process that ends with the test."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.ops = 0
        real = dist.batch_isend_irecv

        def counting(ops):
            self.ops += len(ops)
            return real(ops)

        dist.batch_isend_irecv = counting


def counted_step(comm, wire, pp, stage, vp, M, **kw) -> tuple[int, int, tuple]:
    """Run one checked step; return (messages by stats, messages by the wire wrapper, run)."""
    comm.reset_stats()
    before = wire.ops
    run = pipeline_run(comm, pp, stage, vp, M, **kw)
    check_against_serial(pp, stage, vp, M, *run[:5], forward_only=kw.get("forward_only", False))
    return comm.stats["wire_sends"] + comm.stats["wire_recvs"], wire.ops - before, run


def _pipelines(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megastrategy.pipeline import forward_only_steps, training_steps

    g4 = dist.new_group([0, 1, 2, 3])
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    wire = WireCounter()
    report: dict = {}
    for pp, vp, M, schedule in [(*c, "1f1b") for c in CONFIGS] + OTHER:
        group, ranks = (g4, [0, 1, 2, 3]) if pp == 4 else (g2[rank // 2], [0, 1] if rank < 2 else [2, 3])
        stage = ranks.index(rank)
        comm = PipelineCommunicator(pp_group=group, pp_ranks=ranks, pp_rank=stage, device="cpu")
        minimum = schedule_minimum(training_steps(schedule, M, pp, stage, vp), pp, stage, vp)
        counts = [counted_step(comm, wire, pp, stage, vp, M, schedule=schedule)[:2] for _ in range(3)]
        assert counts[0][0] > minimum  # the first step describes every tensor: header + payload
        assert counts[1:] == [(minimum, minimum)] * 2, (pp, vp, M, schedule, stage, counts, minimum)
        assert comm.stats["header_bytes"] == 32 * (comm.stats["messages"])  # trailers only, no headers
        # overlapped receives post the same messages, just earlier
        assert counted_step(comm, wire, pp, stage, vp, M, schedule=schedule, overlap=True)[:2] == (minimum, minimum)
        # another sequence length on some microbatches: right results (resyncs), then the minimum again
        changed = counted_step(comm, wire, pp, stage, vp, M, schedule=schedule, varlen=True)
        assert changed[0] > minimum and comm.stats["resyncs"] > 0
        assert counted_step(comm, wire, pp, stage, vp, M, schedule=schedule, varlen=True)[:2] == (minimum, minimum)
        assert counted_step(comm, wire, pp, stage, vp, M, schedule=schedule)[0] > minimum  # back: resync once
        report[(pp, vp, M, schedule, stage)] = (counts, minimum)
        # forward-only steps have their own memory: they do not disturb the training predictions
        fwd_min = schedule_minimum(forward_only_steps(M, vp), pp, stage, vp)
        for _ in range(2):
            last = counted_step(comm, wire, pp, stage, vp, M, forward_only=True)
        assert last[:2] == (fwd_min, fwd_min)
        assert counted_step(comm, wire, pp, stage, vp, M, schedule=schedule)[:2] == (minimum, minimum)
        comm.wait_all()
    dist.barrier()
    return report


def _errors_and_scatter(rank: int, world: int) -> dict:
    """Predicted messages keep the checks (shape, microbatch: a clear error, stream in step);
    scatter-gather over tp2 x pp2 follows shape changes across steps."""
    import torch.distributed as dist

    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ppg = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    out: dict = {}
    stage = rank % 2
    comm = PipelineCommunicator(pp_group=g2[rank // 2], pp_ranks=[0, 1] if rank < 2 else [2, 3], pp_rank=stage,
                                device="cpu")
    x = torch.arange(6.0).reshape(2, 3)
    for step in range(2):  # the second step's messages are predicted
        comm.begin_step()
        if stage == 0:
            for mb in range(3):
                comm.send_forward(x + mb, microbatch=mb)
        else:
            got = comm.recv_forward(expect_microbatch=0)
            assert torch.equal(got, x)
            with pytest.raises(RuntimeError) as err:
                comm.recv_forward(expect_shape=(3, 2))
            out[f"shape{step}"] = str(err.value)
            with pytest.raises(RuntimeError) as err:
                comm.recv_forward(expect_microbatch=7)
            out[f"mb{step}"] = str(err.value)
        comm.wait_all()
    out["stats"] = dict(comm.stats)

    tp_rank, pp_stage = rank % 2, rank // 2
    sg = PipelineCommunicator(pp_group=ppg[tp_rank], pp_ranks=[tp_rank, tp_rank + 2], pp_rank=pp_stage,
                              device="cpu", tp_group=tp[pp_stage])
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen), torch.randn(4, 8, generator=gen),
               torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen).double()]
    for t in tensors:  # step by step: new, predicted, changed, changed to an odd size (full send), dtype change
        sg.begin_step()
        if pp_stage == 0:
            sg.send_forward(t, microbatch=0)
        else:
            got = sg.recv_forward(expect_microbatch=0)
            assert got.dtype == t.dtype and torch.equal(got, t)
        sg.wait_all()
    out["sg_stats"] = dict(sg.stats)
    dist.barrier()
    return out


def test_schedule_minimum_after_the_first_step():
    reports = run_distributed(_pipelines, 4, timeout=240)
    merged = {k: v for r in reports for k, v in r.items()}
    # the example: 1F1B pp=2 m=4, stage 0 sends 4 activations and receives 4 gradients
    assert merged[(2, 1, 4, "1f1b", 0)][1] == 8
    assert merged[(4, 1, 8, "1f1b", 1)][1] == 32  # a middle stage: both directions, both neighbours


def test_predicted_messages_keep_their_checks_and_scatter_gather():
    results = run_distributed(_errors_and_scatter, 4, timeout=90)
    for r in (1, 3):
        for step in (0, 1):
            assert "expected shape (3, 2)" in results[r][f"shape{step}"], results[r]
            assert "received shape (2, 3)" in results[r][f"shape{step}"]
            assert "microbatch 7" in results[r][f"mb{step}"] and "microbatch 2" in results[r][f"mb{step}"]
    sender = results[0]["stats"]
    assert sender["wire_sends"] == 3 * 2 + 3  # first step header + payload, second one message each
    sg0 = results[0]["sg_stats"]
    assert sg0["scatter_gather"] == 3 and sg0["resyncs"] == 3  # (4, 8), (3, 5) and the dtype change
    assert sg0["wire_sends"] == 2 + 1 + 3 + 3 + 3


def test_loopback_predicts_too():
    """pp_size == 1 (the rank is its own neighbour) goes through the same protocol in-process."""
    comm = PipelineCommunicator(pp_group=None, pp_ranks=[0], pp_rank=0, device="cpu")
    for shape in [(2, 3), (2, 3), (4,), (4,)]:
        comm.reset_stats()
        comm.begin_step()
        t = torch.randn(shape)
        h = comm.irecv_forward()
        comm.send_forward(t, microbatch=0)
        assert torch.equal(h.wait(), t)
        comm.wait_all()
    assert comm.stats["wire_sends"] == comm.stats["wire_recvs"] == 1  # predicted again after the change


def test_executor_begins_a_step_per_run():
    class Recorder:
        pp_size, pp_rank = 1, 0
        labels: list = []

        def begin_step(self, label):
            self.labels.append(label)

        def wait_all(self):
            pass

    comm = Recorder()
    ex = PipelineExecutor(comm, pp_size=1, pp_rank=0)
    ex.run([(True, 0, 0), (False, 0, 0)], forward_step=lambda c, m, i: torch.ones((), requires_grad=True), num_microbatches=1)
    ex.run([(True, 0, 0)], forward_step=lambda c, m, i: torch.ones((), requires_grad=True), num_microbatches=1, forward_only=True)
    assert comm.labels == ["train", "forward_only"]
