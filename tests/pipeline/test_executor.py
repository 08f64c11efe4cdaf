"""PipelineExecutor against a serial model, on real gloo processes.

One spawn of 4 ranks runs every configuration: pp=4 uses all ranks, pp=2 runs two
independent pipelines (ranks 0-1 and 2-3) at once, pp=3 leaves rank 3 idle.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megastrategy.pipeline import assign_layers, forward_only_steps, schedule_steps, simulate_schedule, training_steps
from megastrategy.pipeline.executor import PipelineExecutor
from megastrategy.pipeline.p2p import PipelineCommunicator
from tests.helpers.dist import run_distributed

CONFIGS = [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8), (3, 1, 5)]  # (pp, vp, num_microbatches)
HIDDEN = 8
TOL = 1e-6


def make_layers(num_layers: int) -> nn.ModuleList:
    torch.manual_seed(1234)
    return nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(num_layers))


def make_inputs(num_microbatches: int, varlen: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randn(2, (3 + m % 3) if varlen else 4, HIDDEN, generator=gen) for m in range(num_microbatches)]


def run_layers(layers, indices, x):
    for i in indices:
        x = torch.tanh(layers[i](x))
    return x


def serial_reference(num_layers: int, inputs: list[torch.Tensor]):
    """Per-microbatch losses and every layer's gradient of sum_m loss_m / M, on one process."""
    layers = make_layers(num_layers)
    losses = []
    for x in inputs:
        loss = run_layers(layers, range(num_layers), x).pow(2).mean()
        (loss / len(inputs)).backward()
        losses.append(loss.detach())
    return losses, [(lin.weight.grad.clone(), lin.bias.grad.clone()) for lin in layers]


def pipeline_run(comm, pp, rank, vp, M, *, varlen=False, overlap=False, forward_only=False, deallocate=True,
                 schedule="1f1b", reuse=True):
    num_layers = 2 * pp * vp
    layers = make_layers(num_layers)
    mine = assign_layers(num_layers, pp, vp)[rank]
    inputs = make_inputs(M, varlen)
    last = (pp - 1, vp - 1)
    sent = []  # activations handed to the executor, to check the pseudo-free

    def forward_step(chunk, mb, inp):
        stage_first = rank == 0 and chunk == 0
        assert (inp is None) == stage_first
        if not stage_first and not forward_only:
            assert inp.is_leaf and inp.requires_grad
        x = run_layers(layers, mine[chunk], inputs[mb] if stage_first else inp)
        if (rank, chunk) == last:
            return x.pow(2).mean()
        sent.append(x)
        return x

    ex = PipelineExecutor(comm, pp_size=pp, pp_rank=rank, vp_size=vp, overlap_p2p_comm=overlap,
                          deallocate_outputs=deallocate, reuse_saved_gradients=reuse)
    steps = forward_only_steps(M, vp) if forward_only else training_steps(schedule, M, pp, rank, vp)
    outs = ex.run(steps, forward_step=forward_step, num_microbatches=M, forward_only=forward_only, loss_scale=1.0 / M)
    return ex, outs, layers, mine, inputs, sent


def check_against_serial(pp, rank, vp, M, ex, outs, layers, mine, inputs, forward_only=False):
    losses, grads = serial_reference(2 * pp * vp, inputs)
    if rank == pp - 1:
        assert len(outs) == M
        for m in range(M):
            if forward_only:
                assert torch.allclose(outs[m], losses[m], atol=TOL, rtol=0), (m, outs[m], losses[m])
            else:
                assert abs(outs[m].item() - losses[m].item()) <= TOL, (m, outs[m], losses[m])
    else:
        assert outs == []
    for chunk in mine:
        for i in chunk:
            if forward_only:
                assert layers[i].weight.grad is None
                continue
            w, b = grads[i]
            assert torch.allclose(layers[i].weight.grad, w, atol=TOL, rtol=0), (pp, vp, rank, i)
            assert torch.allclose(layers[i].bias.grad, b, atol=TOL, rtol=0), (pp, vp, rank, i)


def _worker(rank: int, world: int) -> dict:
    import time

    import torch.distributed as dist

    g4 = dist.new_group([0, 1, 2, 3])
    g3 = dist.new_group([0, 1, 2])
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    report: dict = {"peaks": {}, "times": {}}
    for pp, vp, M in CONFIGS:
        if pp == 4:
            group, ranks = g4, [0, 1, 2, 3]
        elif pp == 2:
            group, ranks = g2[rank // 2], ([0, 1] if rank < 2 else [2, 3])
        else:
            if rank == 3:
                continue
            group, ranks = g3, [0, 1, 2]
        stage = ranks.index(rank)
        comm = PipelineCommunicator(pp_group=group, pp_ranks=ranks, pp_rank=stage, device="cpu")
        t0 = time.perf_counter()
        for variant in ("plain", "overlap", "varlen", "keep_outputs"):
            ex, outs, layers, mine, inputs, sent = pipeline_run(
                comm, pp, stage, vp, M, varlen=variant == "varlen", overlap=variant == "overlap",
                deallocate=variant != "keep_outputs",
            )
            check_against_serial(pp, stage, vp, M, ex, outs, layers, mine, inputs)
            expected_peak = simulate_schedule(M, pp, vp).peak_in_flight[stage]
            assert ex.peak_in_flight == expected_peak, (variant, pp, vp, M, stage, ex.peak_in_flight, expected_peak)
            report["peaks"][(pp, vp, M, stage)] = ex.peak_in_flight
            assert ex.last_run["forwards"] == ex.last_run["backwards"] == M * vp
            if variant == "keep_outputs":
                assert ex.last_run["freed_bytes"] == 0
                assert all(x.untyped_storage().nbytes() == x.numel() * 4 for x in sent)
            else:
                # every sent activation was pseudo-freed: one element left, shape kept
                assert len(sent) == (M * vp if stage != pp - 1 else M * (vp - 1))
                assert all(x.untyped_storage().nbytes() == 4 for x in sent)
                assert ex.last_run["freed_bytes"] == sum(x.numel() * 4 for x in sent)
        if vp == 1:  # ZB-H1: B then deferred W, same losses and gradients as the serial model
            for overlap, reuse in ((False, True), (True, True), (False, False)):
                ex, outs, layers, mine, inputs, _ = pipeline_run(comm, pp, stage, vp, M, overlap=overlap,
                                                                 schedule="zb_h1", reuse=reuse)
                check_against_serial(pp, stage, vp, M, ex, outs, layers, mine, inputs)
                assert ex.peak_in_flight == simulate_schedule(M, pp, schedule="zb_h1").peak_in_flight[stage]
                assert ex.last_run["backwards"] == ex.last_run["weight_steps"] == M
        for overlap in (False, True):
            ex, outs, layers, mine, inputs, _ = pipeline_run(comm, pp, stage, vp, M, forward_only=True, overlap=overlap)
            check_against_serial(pp, stage, vp, M, ex, outs, layers, mine, inputs, forward_only=True)
            assert ex.peak_in_flight == 0
        comm.wait_all()
        assert comm.pending_sends == 0
        report["times"][(pp, vp, M)] = time.perf_counter() - t0
    dist.barrier()
    return report


def test_executor_matches_serial_model():
    reports = run_distributed(_worker, 4, timeout=100)
    for pp, vp, M in CONFIGS:
        for stage in range(pp):
            assert (pp, vp, M, stage) in reports[stage]["peaks"]
    # 1F1B keeps at most pp - rank microbatches (fewer when M is small)
    assert [reports[r]["peaks"][(4, 1, 8, r)] for r in range(4)] == [4, 3, 2, 1]


# ---------------------------------------------------------------------------------------
# single process (pp_size == 1: the communicator loops back to itself)
# ---------------------------------------------------------------------------------------
def _single_stage(vp, M, overlap=False):
    comm = PipelineCommunicator(pp_group=None, pp_ranks=[0], pp_rank=0, device="cpu")
    ex, outs, layers, mine, inputs, _ = pipeline_run(comm, 1, 0, vp, M, overlap=overlap)
    check_against_serial(1, 0, vp, M, ex, outs, layers, mine, inputs)
    return ex


@pytest.mark.parametrize("overlap", [False, True])
def test_single_stage_with_chunks(overlap):
    ex = _single_stage(2, 3, overlap)
    assert ex.peak_in_flight == simulate_schedule(3, 1, 2).peak_in_flight[0]
    _single_stage(1, 3)


def test_forward_step_error_propagates():
    comm = PipelineCommunicator(pp_group=None, pp_ranks=[0], pp_rank=0, device="cpu")
    ex = PipelineExecutor(comm, pp_size=1, pp_rank=0, vp_size=2)

    class Boom(Exception):
        pass

    def forward_step(chunk, mb, inp):
        if chunk == 1 and mb == 1:
            raise Boom("user code failed")
        return (inp * 2).sum() if inp is not None else torch.ones(3, requires_grad=True).sum() * torch.ones(2)

    with pytest.raises(Boom, match="user code failed"):
        ex.run(schedule_steps(2, 1, 0, 2), forward_step=forward_step, num_microbatches=2)


def test_bad_schedules_and_outputs():
    comm = PipelineCommunicator(pp_group=None, pp_ranks=[0], pp_rank=0, device="cpu")
    ex = PipelineExecutor(comm, pp_size=1, pp_rank=0)
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="backward without a preceding forward"):
        ex.run([(False, 0, 0)], forward_step=lambda c, m, x: w.sum(), num_microbatches=1)
    with pytest.raises(ValueError, match="forwards without a backward"):
        ex.run([(True, 0, 0)], forward_step=lambda c, m, x: w.sum(), num_microbatches=1)
    from megastrategy.pipeline import StepPart

    split = [(True, 0, 0), (False, 0, 0, StepPart.WEIGHT), (False, 0, 0, StepPart.INPUT)]
    with pytest.raises(ValueError, match="weight-gradient step before the input-gradient step"):
        ex.run(split, forward_step=lambda c, m, x: w.sum(), num_microbatches=1)
    with pytest.raises(ValueError, match=r"B then W\) at \(chunk, microbatch\) \[\(0, 0\)\]"):
        ex.run(split[:1] + split[2:], forward_step=lambda c, m, x: w.sum(), num_microbatches=1)
    with pytest.raises(ValueError, match="backward_fn replaces a whole backward"):
        ex.run(training_steps("zb_h1", 1, 1, 0), forward_step=lambda c, m, x: w.sum(), num_microbatches=1,
               backward_fn=lambda loss: None)
    with pytest.raises(ValueError, match="scalar loss"):
        ex.run(schedule_steps(1, 1, 0), forward_step=lambda c, m, x: w * 2, num_microbatches=1)
    with pytest.raises(TypeError, match="must return a Tensor"):
        ex.run(schedule_steps(1, 1, 0), forward_step=lambda c, m, x: {"loss": w.sum()}, num_microbatches=1)
    with pytest.raises(ValueError, match="stage 0 of 1"):
        PipelineExecutor(comm, pp_size=2, pp_rank=1)
