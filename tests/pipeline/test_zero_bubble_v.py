"""ZB-V orders: well-formed, no deadlock, their bubble beside 1F1B's and ZB-H1's, and the executor
running them (V placement, loss on rank 0) with the serial model's losses and gradients."""
import itertools

import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline import forward_only_steps, simulate_schedule
from megastrategy.pipeline.executor import PipelineExecutor
from megastrategy.pipeline.p2p import PipelineCommunicator
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.schedules import StepPart
from megastrategy.pipeline.schedule_choice import schedule_placement, training_steps, validate_pipeline_schedule
from megastrategy.pipeline.zero_bubble_v import zb_v_steps
from tests.helpers.dist import run_distributed
from tests.pipeline.test_p2p_messages import WireCounter
from tests.pipeline.test_executor import TOL, make_inputs, run_layers, serial_reference

GRID = [(p, m) for p, m in itertools.product([2, 3, 4, 6], [3, 4, 5, 7, 8, 11, 16, 24]) if m >= 2 * p - 1]


@pytest.mark.parametrize("p,m", GRID)
def test_every_chunk_and_microbatch_gets_f_then_b_then_w_once(p, m):
    for rank in range(p):
        steps = zb_v_steps(m, p, rank)
        assert len(steps) == 6 * m
        position = {(s.kind, s.chunk, s.microbatch): i for i, s in enumerate(steps)}
        assert len(position) == 6 * m
        for chunk, mb in itertools.product((0, 1), range(m)):
            assert position[("F", chunk, mb)] < position[("B", chunk, mb)] < position[("W", chunk, mb)]


@pytest.mark.parametrize("p,m", GRID)
def test_dependencies_across_ranks_hold_without_deadlock(p, m):
    """The simulator runs every rank's order; each step starts after what it needs, across ranks."""
    stats = simulate_schedule(m, p, schedule="zb_v", p2p_time=0.1)
    v = StagePlacement.build("v", p, 2)
    end = {(t.kind, v.stage(t.rank, t.chunk), t.microbatch): t.end for row in stats.timeline for t in row}
    for row in stats.timeline:
        for t in row:
            s = v.stage(t.rank, t.chunk)
            if t.kind == "F" and s > 0:
                assert t.start >= end[("F", s - 1, t.microbatch)] - 1e-9
            if t.kind == "B":
                assert t.start >= end[("F", s, t.microbatch)] - 1e-9
                if s < 2 * p - 1:
                    assert t.start >= end[("B", s + 1, t.microbatch)] - 1e-9
            if t.kind == "W":
                assert t.start >= end[("B", s, t.microbatch)] - 1e-9


def test_bubble_beside_1f1b_and_zb_h1_at_pp4_m8():
    """F = B = W = 1 per whole stage; a ZB-V chunk is half a stage, so its steps cost 0.5."""
    one_f_one_b = simulate_schedule(8, 4, forward_time=1.0, backward_time=2.0)
    zb_h1 = simulate_schedule(8, 4, forward_time=1.0, backward_time=2.0, schedule="zb_h1")
    zb_v = simulate_schedule(8, 4, forward_time=0.5, backward_time=1.0, schedule="zb_v")
    assert one_f_one_b.makespan == pytest.approx(33.0) and zb_h1.makespan == pytest.approx(27.0)
    assert zb_v.makespan == pytest.approx(25.5)
    assert zb_v.idle == pytest.approx([1.5] * 4)  # half of ZB-H1's (p - 1) F
    assert zb_v.bubble_fraction == pytest.approx(1.5 / 25.5)  # 5.9%, against 11.1% and 27.3%
    # memory: 2p chunk-microbatches of half a stage each = 1F1B's peak of p whole ones
    assert max(zb_v.peak_in_flight) == 2 * max(one_f_one_b.peak_in_flight) == 8


def test_evaluation_runs_through_the_v_without_deadlock():
    stats = simulate_schedule(8, 4, forward_only=True, schedule="zb_v", p2p_time=0.1)
    assert stats.vp_size == 2 and all(len(row) == 16 for row in stats.timeline)


def test_rules_name_the_fix():
    with pytest.raises(MegatronConfigError, match=r"num_microbatches >= 7"):
        zb_v_steps(6, 4, 0)
    with pytest.raises(MegatronConfigError, match=r"pp >= 2"):
        zb_v_steps(4, 1, 0)
    with pytest.raises(MegatronConfigError, match=r"vp=None or 2"):
        validate_pipeline_schedule("zb_v", 2, 4)
    with pytest.raises(MegatronConfigError, match=r"pp >= 2"):
        validate_pipeline_schedule("zb_v", 1, 1)
    assert validate_pipeline_schedule("zb_v", 2, 1) == validate_pipeline_schedule("zb_v", 2, 2) == "zb_v"


def test_v_placement_puts_last_stage_on_rank_0():
    v = schedule_placement("zb_v", 4)
    assert v.table == ((0, 7), (1, 6), (2, 5), (3, 4)) and v.last_rank == 0
    assert v.next_rank(3, 0) == 3 and v.next_rank(1, 1) == 0 and v.prev_rank(0, 1) == 1
    assert assign_layers(16, 4, 2, v)[0] == [[0, 1], [14, 15]]


def test_stage_flags_follow_the_v():
    """Rank 0 runs the first and the last stage: it keeps the embedding and the head, and a tied
    weight's two uses are one parameter there (no copy to keep equal)."""
    from megastrategy.pipeline.stage import PipelineStage

    v = schedule_placement("zb_v", 2)
    first = PipelineStage(stack_path="blocks", chunks=[[0], [3]], pp_rank=0, pp_size=2, vp_size=2, placement=v)
    other = PipelineStage(stack_path="blocks", chunks=[[1], [2]], pp_rank=1, pp_size=2, vp_size=2, placement=v)
    assert first.is_first_virtual(0) and first.is_last_virtual(1) and not first.is_last_virtual(0)
    assert not any(other.is_first_virtual(c) or other.is_last_virtual(c) for c in (0, 1))
    ring = PipelineStage(stack_path="blocks", chunks=[[1], [3]], pp_rank=1, pp_size=2, vp_size=2)
    assert ring.is_last_virtual(1) and not ring.is_first_virtual(0)


def test_executor_refuses_a_placement_for_another_layout():
    from megastrategy.pipeline.executor import LocalCommunicator

    with pytest.raises(ValueError, match="placement 'v' is for pp_size=2"):
        PipelineExecutor(LocalCommunicator(), pp_size=1, pp_rank=0, vp_size=2, placement=schedule_placement("zb_v", 2))


# ------------------------------------------------------------------------------------------
# the executor on real processes: V placement, messages up and down, the turn a local copy
# ------------------------------------------------------------------------------------------
CONFIGS = [(2, 3), (2, 6), (4, 7), (4, 8)]  # (pp, num_microbatches)


def zb_v_run(comm, pp, rank, M, overlap):
    from tests.pipeline.test_executor import make_layers

    v = schedule_placement("zb_v", pp)
    num_layers = 4 * pp
    layers, mine, inputs = make_layers(num_layers), assign_layers(num_layers, pp, 2, v)[rank], make_inputs(M, True)

    def forward_step(chunk, mb, inp):
        first, last = v.stage(rank, chunk) == 0, v.stage(rank, chunk) == 2 * pp - 1
        assert (inp is None) == first
        x = run_layers(layers, mine[chunk], inputs[mb] if first else inp)
        return x.pow(2).mean() if last else x

    ex = PipelineExecutor(comm, pp_size=pp, pp_rank=rank, vp_size=2, overlap_p2p_comm=overlap, placement=v)
    outs = ex.run(training_steps("zb_v", M, pp, rank, 2), forward_step=forward_step, num_microbatches=M,
                  loss_scale=1.0 / M)
    losses, grads = serial_reference(num_layers, inputs)
    assert len(outs) == (M if rank == 0 else 0)
    for m, out in enumerate(outs):
        assert abs(out.item() - losses[m].item()) <= TOL
    for i in (i for chunk in mine for i in chunk):
        assert torch.allclose(layers[i].weight.grad, grads[i][0], atol=TOL, rtol=0), (pp, rank, i)
        assert torch.allclose(layers[i].bias.grad, grads[i][1], atol=TOL, rtol=0), (pp, rank, i)
    assert ex.peak_in_flight == simulate_schedule(M, pp, schedule="zb_v").peak_in_flight[rank]
    assert ex.last_run["backwards"] == ex.last_run["weight_steps"] == 2 * M
    # evaluation runs the same V, forwards only: the loss is still on rank 0
    for p in layers.parameters():
        p.grad = None
    evaluated = ex.run(forward_only_steps(M, 2), forward_step=forward_step, num_microbatches=M, forward_only=True)
    assert [o.item() for o in evaluated] == pytest.approx([o.item() for o in outs], abs=TOL)


def v_minimum(pp: int, rank: int, M: int) -> int:
    """The schedule's minimum of messages for this rank: one per activation or gradient that
    crosses to another rank (the V's turn stays on its rank), training and evaluation runs."""
    v = schedule_placement("zb_v", pp)
    count = 0
    for step in [*training_steps("zb_v", M, pp, rank, 2), *forward_only_steps(M, 2)]:
        if not step.is_forward and step.part is StepPart.WEIGHT:
            continue
        s = v.stage(rank, step.chunk)
        count += (s != 0 and v.rank_of(s - 1) != rank) + (s != v.num_stages - 1 and v.rank_of(s + 1) != rank)
    return count


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    g4 = dist.new_group([0, 1, 2, 3])
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    wire = WireCounter()  # point-to-point ops that reach the wire (the V's turn is a local copy)
    for pp, M in CONFIGS:
        group, ranks = (g4, [0, 1, 2, 3]) if pp == 4 else (g2[rank // 2], [0, 1] if rank < 2 else [2, 3])
        comm = PipelineCommunicator(pp_group=group, pp_ranks=ranks, pp_rank=ranks.index(rank), device="cpu")
        stage = ranks.index(rank)
        for overlap in (False, True):
            for _ in range(2):  # the second run's messages are predicted: one per tensor
                before = wire.ops
                zb_v_run(comm, pp, stage, M, overlap)
            assert wire.ops - before == v_minimum(pp, stage, M), (pp, M, stage, wire.ops - before)
        comm.wait_all()
        assert comm.pending_sends == 0
    dist.barrier()
    return {}


def test_executor_runs_zb_v_like_the_serial_model():
    run_distributed(_worker, 4, timeout=120)
