"""Capture and replay on CPU, with the graphing function replaced by a stub that keeps a real
graph's static-buffer semantics.

:class:`StubGraphFn` behaves like ``make_graphed_callables`` where it matters for slots: each
graphed callable owns ONE set of static inputs and outputs and ONE saved autograd state;
a replay copies its inputs into the static inputs, overwrites the static outputs, returns
them (so eager code downstream saves views of them), and replaces the saved state that its
backward will use. Replaying a slot whose microbatch has not run its backward yet therefore
corrupts that microbatch's gradients, exactly as on a GPU; the tests below show the harness
catches that, a replay in the wrong slot, and a missing fallback.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megastrategy.cuda_graphs import CudaGraphManager, SlotState, SlotTracker, plan_for_schedule
from megastrategy.cuda_graphs.capture import CudaGraphCaptureError, capture_graphs
from megastrategy.pipeline.executor import PipelineExecutor
from megastrategy.pipeline.p2p import PipelineCommunicator
from megastrategy.pipeline.schedules import schedule_steps
from tests.helpers.stub_cuda_graphs import StubGraphFn

D, HEADS, SEQ = 8, 2, 5


# -----------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.ff = nn.Linear(D, D)

    def forward(self, x):
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a * self.gate  # the multiplication saves `a`, a view of the graph's static output
        return x + torch.tanh(self.ff(x))


class Model(nn.Module):
    def __init__(self, n_layer=2):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))

    def forward(self, x, layers=None):
        for i in layers if layers is not None else range(len(self.blocks)):
            x = self.blocks[i](x)
        return x


def batches(M, step, batch=2):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(batch, SEQ, D, generator=g) for _ in range(M)]


def loss_of(out):
    return out.pow(2).mean()


def run_rank_order(model, steps, xs, graphs=None):
    """One training step in the order of a rank's schedule (all chunk 0): per-mb losses."""
    losses, held = {}, {}
    for is_forward, chunk, mb in (step[:3] for step in steps):  # whole backwards: graphs refuse B/W splits
        if is_forward:
            if graphs is not None:
                graphs.on_forward(chunk, mb)
            held[mb] = loss_of(model(xs[mb])) / len(xs)
            losses[mb] = held[mb].detach()
        else:
            held.pop(mb).backward()
            if graphs is not None:
                graphs.on_backward(chunk, mb)
    return [losses[m] for m in range(len(xs))]


def eager_step(model, xs):
    losses = []
    for x in xs:
        loss = loss_of(model(x)) / len(xs)
        loss.backward()
        losses.append(loss.detach())
    return losses


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def sgd(model, lr=0.1):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)  # in place: the graphs read the live parameters
            p.grad = None


def assert_same(a, b, tol=1e-6):
    """Every tensor close; a failure names ALL the differing ones with their largest difference."""
    assert a.keys() == b.keys()
    bad = {
        k: f"{(a[k] - b[k]).abs().max().item():.3e} (largest value {b[k].abs().max().item():.3e})"
        for k in a if not torch.allclose(a[k], b[k], atol=tol, rtol=tol)
    }
    assert not bad, f"differ beyond {tol}: {bad}"


def check_replays(stub, report, plan):
    """Every replay used the graph captured for the slot the plan gives its (chunk, microbatch)."""
    wrong = []
    for call, _pos, state in stub.replays:
        chunk, slot, _ = report.calls[call]
        if state is None or (chunk, slot) != (state.chunk, plan.slot_of[(state.chunk, state.microbatch)]):
            wrong.append((call, state))
    return wrong


def make_pair(n_layer=2, **kw):
    eager = Model(n_layer)
    graphed = copy.deepcopy(eager)
    stub = StubGraphFn()
    mgr = CudaGraphManager(graphed.blocks, ["attn"], stack_path="blocks", graph_fn=stub, **kw)
    stub.tracker = mgr.tracker
    return eager, graphed, mgr, stub


# -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp_rank", [0, 2])
def test_1f1b_rank_order_matches_eager_with_slot_reuse(pp_rank):
    pp, M = 4, 8
    eager, graphed, mgr, stub = make_pair(pp_size=pp, pp_rank=pp_rank)
    steps = schedule_steps(M, pp, pp_rank)
    for step in range(3):
        xs = batches(M, step)
        ref = eager_step(eager, xs)
        plan = mgr.begin_step(M)
        got = run_rank_order(graphed, steps, xs, mgr)
        report = mgr.end_step()
        torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-6, rtol=1e-6)
        assert_same(grads(graphed), grads(eager))
        sgd(eager), sgd(graphed)
        if step == 0:  # recorded eagerly, captured at the end of the step
            assert report is not None and stub.replays == []
            assert plan.num_slots == (pp - pp_rank,)
            # one call per slot, each holding both blocks' attention in forward order
            assert [(c, s) for c, s, _ in report.calls] == [(0, s) for s in range(pp - pp_rank)]
            assert all(names == ["blocks.0.attn", "blocks.1.attn"] for _, _, names in report.calls)
            assert all(shapes == [[(2, SEQ, D)] * 3] * 2 for _, _, shapes in stub.calls)
    assert check_replays(stub, mgr.report, plan) == []
    assert len(stub.replays) == 2 * M * 2  # two steps, M microbatches, two attentions
    assert mgr.counts()["replay"] == 2 * M * 2 and mgr.tracker.refusals == []
    used = {plan.slot_of[(0, s.microbatch)] for _, _, s in stub.replays}
    assert used == set(range(pp - pp_rank))  # slots really are reused (M > slots)


class EveryoneSlotZero(SlotTracker):
    """A broken tracker: grants slot 0 to every forward, in flight or not."""

    def on_forward(self, chunk, microbatch):
        gen = self._generation.get((chunk, 0), 0) + 1
        self._generation[(chunk, 0)] = gen
        self.current = SlotState(chunk, microbatch, 0, gen)


def test_harness_fails_when_a_slot_is_reused_in_flight():
    """Not vacuous: replaying a slot before its microbatch's backward gives wrong gradients."""
    pp, M = 4, 8
    eager, graphed, mgr, stub = make_pair(pp_size=pp)
    steps = schedule_steps(M, pp, 0)
    xs = batches(M, 0)
    eager_step(eager, xs)
    mgr.begin_step(M), run_rank_order(graphed, steps, xs, mgr), mgr.end_step()
    broken = EveryoneSlotZero()
    for r in mgr.runners:
        r.tracker = broken
    stub.tracker = broken
    for m in (eager, graphed):
        for p in m.parameters():
            p.grad = None
    xs = batches(M, 1)
    eager_step(eager, xs)
    broken.begin(mgr.plan)
    run_rank_order(graphed, steps, xs, broken)
    g_eager, g_graphed = grads(eager), grads(graphed)
    worst = max((g_eager[k] - g_graphed[k]).abs().max().item() for k in g_eager)
    assert worst > 1e-3
    assert check_replays(stub, mgr.report, mgr.plan) != []


class ShiftedSlots(SlotTracker):
    """Grants the right number of slots but the wrong one (a permutation): no corruption, wrong slot."""

    def on_forward(self, chunk, microbatch):
        super().on_forward(chunk, microbatch)
        s = self.current
        n = self.plan.num_slots[chunk]
        self.current = SlotState(s.chunk, s.microbatch, (s.slot + 1) % n, s.generation)


def test_harness_detects_replay_in_the_wrong_slot():
    pp, M = 2, 4
    eager, graphed, mgr, stub = make_pair(pp_size=pp)
    steps = schedule_steps(M, pp, 0)
    mgr.begin_step(M), run_rank_order(graphed, steps, batches(M, 0), mgr), mgr.end_step()
    shifted = ShiftedSlots()
    for r in mgr.runners:
        r.tracker = shifted
    stub.tracker = shifted
    shifted.begin(mgr.plan)
    run_rank_order(graphed, steps, batches(M, 1), shifted)
    assert len(check_replays(stub, mgr.report, mgr.plan)) == len(stub.replays) > 0


def test_interleaved_executor_end_to_end():
    """The real executor (one stage, two chunks) drives the tracker through its callbacks."""
    M = 4
    eager = Model(4)
    graphed = copy.deepcopy(eager)
    stub = StubGraphFn()
    mgr = CudaGraphManager(graphed.blocks, ["attn"], stack_path="blocks", chunks=[[0, 1], [2, 3]], vp_size=2,
                           graph_fn=stub)
    stub.tracker = mgr.tracker
    comm = PipelineCommunicator(pp_group=None, pp_ranks=[0], pp_rank=0, device="cpu")
    ex = PipelineExecutor(comm, pp_size=1, pp_rank=0, vp_size=2)
    seen = []

    for step in range(3):
        xs = batches(M, step)
        ref = eager_step(eager, xs)

        def forward_step(chunk, mb, inp):
            seen.append((chunk, mb, mgr.tracker.current))
            if chunk == 0:
                return graphed(xs[mb], layers=[0, 1])
            return loss_of(graphed(inp, layers=[2, 3]))

        plan = mgr.begin_step(M)
        losses = ex.run(schedule_steps(M, 1, 0, 2), forward_step=forward_step, num_microbatches=M,
                        loss_scale=1.0 / M, on_forward=mgr.on_forward, on_backward=mgr.on_backward)
        mgr.end_step()
        torch.testing.assert_close(torch.stack(losses) / M, torch.stack(ref), atol=1e-6, rtol=1e-6)
        assert_same(grads(graphed), grads(eager))
        sgd(eager), sgd(graphed)
    assert plan.num_slots == (2, 1)
    assert all(state.chunk == c and state.microbatch == m for c, m, state in seen)
    # captures follow the schedule's first use of each (chunk, slot): F(c0,mb0) F(c1,mb0) F(c0,mb1) ...
    assert plan.capture_order == ((0, 0), (1, 0), (0, 1))
    assert [(c, s, names) for c, s, names in mgr.report.calls] == [
        (0, 0, ["blocks.0.attn", "blocks.1.attn"]), (1, 0, ["blocks.2.attn", "blocks.3.attn"]),
        (0, 1, ["blocks.0.attn", "blocks.1.attn"]),
    ]
    assert [c[0] for c in stub.calls] == [0, 1, 2]
    assert check_replays(stub, mgr.report, plan) == []
    assert mgr.counts()["replay"] == 2 * M * 4


def test_fallbacks_shape_eval_no_grad_outside_forward_and_repeat():
    M = 2
    eager, graphed, mgr, stub = make_pair()
    steps = schedule_steps(M, 1, 0)
    mgr.begin_step(M), run_rank_order(graphed, steps, batches(M, 0), mgr), mgr.end_step()
    eager_step(eager, batches(M, 0))

    def fresh_grads():
        for m in (eager, graphed):
            for p in m.parameters():
                p.grad = None

    # a different batch size (a short last batch): eager, identical result, no replay
    fresh_grads()
    x = torch.randn(3, SEQ, D)
    mgr.begin_step(1)
    mgr.on_forward(0, 0)
    out = graphed(x)
    loss_of(out).backward()
    mgr.on_backward(0, 0)
    mgr.end_step()
    loss_of(eager(x)).backward()
    assert stub.replays == [] and mgr.counts()["signature"] == 2
    torch.testing.assert_close(out, eager(x), atol=1e-6, rtol=1e-6)
    assert_same(grads(graphed), grads(eager))

    # a call that needs gradient for a different set of inputs is another signature
    mgr.begin_step(1)
    mgr.on_forward(0, 0)
    graphed.blocks[0].attn(x[:2].requires_grad_(), x[:2], x[:2], need_weights=False)
    assert mgr.counts()["signature"] == 3
    mgr.on_backward(0, 0), mgr.end_step()

    # eval mode and no_grad: eager, nothing replayed
    graphed.eval()
    with torch.no_grad():
        graphed(batches(1, 5)[0])
    graphed.train()
    with torch.no_grad():
        graphed(batches(1, 5)[0])
    counts = mgr.counts()
    assert counts["eval"] == 2 and counts["no_grad"] == 2
    # training call outside any announced forward (e.g. Lightning's sanity check or a recompute)
    graphed(batches(1, 5)[0])
    assert mgr.counts()["no_forward"] == 2
    # the same attention twice in one forward (shared weights): the second call runs eagerly
    mgr.begin_step(1)
    mgr.on_forward(0, 0)
    x = batches(1, 6)[0]
    y = graphed.blocks[0](graphed.blocks[0](x))
    y2 = eager.blocks[0](eager.blocks[0](x))
    mgr.on_backward(0, 0), mgr.end_step()
    assert mgr.counts()["repeat"] == 1 and mgr.counts()["replay"] == 1
    torch.testing.assert_close(y, y2, atol=1e-6, rtol=1e-6)
    assert stub.replays and all(s.microbatch == 0 for _, _, s in stub.replays)


def test_runner_keeps_parameter_names_and_uninstalls():
    eager, graphed, mgr, _ = make_pair()
    names = [n for n, _ in graphed.named_parameters()]
    assert names == [n for n, _ in eager.named_parameters()]
    assert graphed.state_dict().keys() == eager.state_dict().keys()
    assert "forward" in graphed.blocks[0].attn.__dict__
    mgr.uninstall()
    assert "forward" not in graphed.blocks[0].attn.__dict__


def test_moe_router_graph_matches_eager_and_keeps_logged_aux_loss():
    from tests.helpers.moe_models import MoEGPT

    torch.manual_seed(0)
    eager = MoEGPT(n_layer=2)
    graphed = copy.deepcopy(eager)
    stub = StubGraphFn()
    mgr = CudaGraphManager(graphed.blocks, ["moe_router"], stack_path="blocks", pp_size=2, graph_fn=stub)
    stub.tracker = mgr.tracker
    M = 4
    steps = schedule_steps(M, 2, 0)
    g = torch.Generator().manual_seed(3)
    for step in range(2):
        ids = [torch.randint(0, 101, (2, 9), generator=g) for _ in range(M)]
        ref = eager_step(eager, ids)
        mgr.begin_step(M)
        got = run_rank_order(graphed, steps, ids, mgr)
        mgr.end_step()
        torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-6, rtol=1e-6)
        assert_same(grads(graphed), grads(eager), tol=1e-5)
        for b_e, b_g in zip(eager.blocks, graphed.blocks):  # recorded aux losses survive slot reuse
            torch.testing.assert_close(b_g.mlp.pop_recorded("aux"), b_e.mlp.pop_recorded("aux"))
        sgd(eager), sgd(graphed)
    assert [names for _, _, names in mgr.report.calls] == [["blocks.0.mlp.router", "blocks.1.mlp.router"]] * 2
    assert mgr.counts()["replay"] == M * 2


def test_capture_errors_raise_or_stay_eager():
    eager, graphed, mgr, stub = make_pair()
    steps = schedule_steps(2, 1, 0)
    mgr.begin_step(2), run_rank_order(graphed, steps, batches(2, 0), mgr)
    mgr.tracker.end()
    fail = StubGraphFn(mgr.tracker, fail_on=lambda c: c.target_module is graphed.blocks[1].attn)
    for r in mgr.runners:
        r.graphs.clear()
    with pytest.raises(CudaGraphCaptureError, match=r"blocks.0.attn', 'blocks.1.attn'.*chunk 0, slot 0.*host"):
        capture_graphs(mgr.runners, mgr.plan, graph_fn=fail)
    with pytest.warns(UserWarning, match="blocks.1.attn stays eager"):
        report = capture_graphs(mgr.runners, mgr.plan, graph_fn=fail, on_error="eager")
    assert report.calls == [(0, 0, ["blocks.0.attn"])] and list(report.failed) == ["blocks.1.attn"]
    assert mgr.runners[1].disabled is not None and mgr.runners[0].graphs


def test_default_backend_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the default backend is usable")
    eager, graphed, mgr, _ = make_pair()
    with pytest.raises(CudaGraphCaptureError, match="needs CUDA"):
        capture_graphs(mgr.runners, plan_for_schedule(1))
