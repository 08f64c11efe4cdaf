"""Model-parallel RNG tracker, RNG-replaying activation checkpoint, TP-region dropout.

All single-process: the streams are per process, nothing here needs a collective.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megastrategy.layers.random import (
    MODEL_PARALLEL_SEED_OFFSET,
    ModelParallelRNGTracker,
    TensorParallelRegionDropout,
    checkpoint,
)

CPU = torch.device("cpu")


def _tracker(tp_rank=0, seed=1234):
    t = ModelParallelRNGTracker(tp_rank=tp_rank, device=CPU)
    t.seed(seed)
    return t


# ------------------------------------------------------------------------------------- tracker
def test_seed_offsets_per_tp_rank():
    assert MODEL_PARALLEL_SEED_OFFSET == 2718
    draws = []
    for r in range(3):
        t = _tracker(tp_rank=r, seed=7)
        assert t.is_initialized
        assert t.initial_seed == 7 + 2718 + r
        with t.fork():
            draws.append(torch.rand(8))
        expected = torch.rand(8, generator=torch.Generator().manual_seed(7 + 2718 + r))
        assert torch.equal(draws[-1], expected)
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


def test_seed_does_not_touch_default_stream():
    torch.manual_seed(3)
    a = torch.rand(4)
    torch.manual_seed(3)
    _tracker(seed=99)
    assert torch.equal(torch.rand(4), a)


def test_fork_leaves_default_stream_untouched_and_advances_own_stream():
    t = _tracker(seed=5)
    torch.manual_seed(0)
    ref = torch.rand(6)
    torch.manual_seed(0)
    x1 = torch.rand(3)
    with t.fork():
        m1 = torch.rand(4)
    x2 = torch.rand(3)
    with t.fork():
        m2 = torch.rand(4)
    assert torch.equal(torch.cat([x1, x2]), ref)
    g = torch.Generator().manual_seed(5 + 2718)
    assert torch.equal(torch.cat([m1, m2]), torch.rand(8, generator=g))


def test_fork_restores_default_stream_on_exception_and_keeps_progress():
    t = _tracker(seed=5)
    torch.manual_seed(0)
    ref = torch.rand(3)
    torch.manual_seed(0)
    with pytest.raises(ZeroDivisionError):
        with t.fork():
            first = torch.rand(2)
            1 / 0
    assert torch.equal(torch.rand(3), ref)
    assert not t.is_forked
    with t.fork():
        second = torch.rand(2)
    g = torch.Generator().manual_seed(5 + 2718)
    assert torch.equal(torch.cat([first, second]), torch.rand(4, generator=g))


def test_nested_fork_is_a_noop():
    t = _tracker(seed=11)
    with t.fork():
        a = torch.rand(2)
        with t.fork():
            b = torch.rand(2)
        c = torch.rand(2)
    g = torch.Generator().manual_seed(11 + 2718)
    assert torch.equal(torch.cat([a, b, c]), torch.rand(6, generator=g))


def test_uninitialized_tracker_errors_clearly():
    t = ModelParallelRNGTracker(tp_rank=1, device=CPU)
    assert not t.is_initialized
    assert t.get_state() == {}
    with pytest.raises(RuntimeError, match="seed"):
        with t.fork():
            pass
    with pytest.raises(ValueError):
        ModelParallelRNGTracker(tp_rank=-1, device=CPU)


def test_get_set_state_roundtrip():
    t = _tracker(seed=21)
    with t.fork():
        torch.rand(5)
    state = t.get_state()
    assert set(state) == {"model_parallel_rng_state"}
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    with t.fork():
        a = torch.rand(7)
    t.set_state(state)
    with t.fork():
        b = torch.rand(7)
    assert torch.equal(a, b)
    # the returned state is a copy: drawing does not change it
    t2 = ModelParallelRNGTracker(tp_rank=0, device=CPU)
    t2.set_state(state)
    with t2.fork():
        assert torch.equal(torch.rand(7), a)
    # inside a fork, get_state sees the live (advanced) state
    t.set_state(state)
    with t.fork():
        torch.rand(7)
        live = t.get_state()
    with t.fork():
        c = torch.rand(3)
    t.set_state(live)
    with t.fork():
        assert torch.equal(torch.rand(3), c)
    t.set_state({})
    assert not t.is_initialized
    with pytest.raises(KeyError):
        t.set_state({"wrong": torch.zeros(1)})


def test_tracker_is_shared_not_copied():
    t = _tracker()
    assert copy.deepcopy(t) is t and copy.copy(t) is t
    drop = TensorParallelRegionDropout(p=0.1, rng_tracker=t)
    seq = copy.deepcopy(nn.Sequential(drop, drop))
    assert seq[0].rng_tracker is t and seq[0] is seq[1]


# ---------------------------------------------------------------------------------- dropout
def test_region_dropout_from_dropout_and_modes():
    t = _tracker(seed=17)
    user = nn.Dropout(p=0.3, inplace=False)
    d = TensorParallelRegionDropout.from_dropout(user, t)
    assert isinstance(d, nn.Dropout) and d.p == 0.3 and d.inplace is False and d.training
    user.eval()
    assert not TensorParallelRegionDropout.from_dropout(user, t).training
    assert "p=0.3" in repr(d)
    with pytest.raises(TypeError):
        TensorParallelRegionDropout.from_dropout(nn.ReLU(), t)
    with pytest.raises(TypeError):
        TensorParallelRegionDropout(p=0.1, rng_tracker=None)

    x = torch.ones(1000)
    torch.manual_seed(1)
    ref_default = torch.rand(3)
    torch.manual_seed(1)
    y = d(x)
    # the mask comes from the tracker's stream, the default stream is untouched
    assert torch.equal(torch.rand(3), ref_default)
    g_state = torch.Generator().manual_seed(17 + 2718).get_state()
    saved = torch.get_rng_state()
    torch.set_rng_state(g_state)
    expected = F.dropout(x, 0.3, True)
    torch.set_rng_state(saved)
    assert torch.equal(y, expected)
    # eval mode and p=0 are the identity and do not draw
    before = t.get_state()["model_parallel_rng_state"]
    d.eval()
    assert d(x) is x
    d.train()
    d0 = TensorParallelRegionDropout(p=0.0, rng_tracker=t)
    assert d0(x) is x
    assert torch.equal(t.get_state()["model_parallel_rng_state"], before)


def test_region_dropout_differs_across_tp_ranks_and_inplace():
    x = torch.ones(64, 64)
    masks = []
    for r in range(2):
        d = TensorParallelRegionDropout(p=0.5, rng_tracker=_tracker(tp_rank=r, seed=0))
        masks.append(d(x) == 0)
    assert not torch.equal(masks[0], masks[1])
    d = TensorParallelRegionDropout(p=0.5, inplace=True, rng_tracker=_tracker(seed=0))
    z = torch.ones(64, 64)
    out = d(z)
    assert out.data_ptr() == z.data_ptr() and torch.equal(out == 0, masks[0])


# ------------------------------------------------------------------------------- checkpoint
class _TwoRegionBlock(nn.Module):
    """Dropout on a "replicated" activation (default stream) and a "sharded" one (tracker)."""

    def __init__(self, tracker):
        super().__init__()
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 8)
        self.shared_drop = nn.Dropout(0.4)
        self.tp_drop = TensorParallelRegionDropout(p=0.4, rng_tracker=tracker)

    def forward(self, x, scale=1.0):
        h = self.shared_drop(x)
        h = torch.relu(self.lin1(h))
        h = self.tp_drop(h)
        with self.tp_drop.rng_tracker.fork():
            h = h * (torch.rand_like(h) + 0.5)  # any other draw on the tracker stream
        return self.shared_drop(self.lin2(h)) * scale + torch.rand_like(x)


def _run(use_ckpt, microbatches=2, rng_between=True, retain=False):
    torch.manual_seed(0)
    tracker = _tracker(seed=123)
    block = _TwoRegionBlock(tracker)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(microbatches)]
    torch.manual_seed(42)
    tracker.seed(42)
    outs = []
    for x in xs:
        if use_ckpt:
            out = checkpoint(block, x, rng_tracker=tracker, scale=2.0)
        else:
            out = block(x, scale=2.0)
        outs.append(out)
    after_forward = (torch.get_rng_state(), tracker.get_state()["model_parallel_rng_state"])
    if rng_between:  # other RNG use between forward and backward, on both streams
        torch.rand(100)
        with tracker.fork():
            torch.rand(100)
    loss = sum((o * torch.arange(o.numel()).view_as(o)).sum() for o in outs)
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    after_backward = (torch.get_rng_state(), tracker.get_state()["model_parallel_rng_state"])
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone() for x in xs]
    return outs, grads, after_forward, after_backward, tracker


@pytest.mark.parametrize("rng_between", [False, True])
def test_checkpoint_replays_both_streams_bitwise(rng_between):
    outs0, grads0, fwd0, bwd0, _ = _run(False, rng_between=rng_between)
    outs1, grads1, fwd1, bwd1, _ = _run(True, rng_between=rng_between)
    for a, b in zip(outs0, outs1):
        assert torch.equal(a, b)
    assert len(grads0) == len(grads1)
    for a, b in zip(grads0, grads1):
        assert torch.equal(a, b)
    # the streams after the forwards are the same with and without checkpointing, and the
    # recompute in backward leaves both where they were before it
    for s0, s1 in zip(fwd0 + bwd0, fwd1 + bwd1):
        assert torch.equal(s0, s1)
    # the next microbatch after backward draws what it would have without checkpointing
    assert torch.equal(bwd0[1], bwd1[1])


def test_checkpoint_retain_graph_recomputes_twice_identically():
    _, grads0, *_ = _run(False, retain=True)
    _, grads1, *_ = _run(True, retain=True)
    for a, b in zip(grads0, grads1):
        assert torch.equal(a, b)


def test_checkpoint_masks_really_differ_from_a_fresh_draw():
    # guard against a vacuous pass: without replaying the tracker the gradients differ
    torch.manual_seed(0)
    tracker = _tracker(seed=1)
    drop = TensorParallelRegionDropout(p=0.5, rng_tracker=tracker)
    x = torch.randn(256, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda t: drop(t) * t, x, use_reentrant=False)
    out.sum().backward()
    broken = x.grad.clone()
    x.grad = None
    tracker.seed(1)
    out2 = checkpoint(lambda t: drop(t) * t, x, rng_tracker=tracker)
    assert torch.equal(out, out2)
    out2.sum().backward()
    tracker.seed(1)
    with torch.no_grad():
        mask = drop(torch.ones(256))
    assert torch.equal(x.grad, mask * x.detach() * 2)
    assert not torch.equal(broken, x.grad)


def test_checkpoint_without_tracker_and_inside_fork():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    torch.manual_seed(0)
    y = checkpoint(lambda t: F.dropout(lin(t), 0.5), x)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    F.dropout(lin(x), 0.5).sum().backward()
    assert torch.equal(g, x.grad)

    t = _tracker()
    with pytest.raises(RuntimeError, match="inside rng_tracker.fork"):
        with t.fork():
            checkpoint(lin, x, rng_tracker=t)


# ------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_and_checkpoint():
    dev = torch.device("cuda", 0)
    t = ModelParallelRNGTracker(tp_rank=1, device=dev)
    t.seed(3)
    torch.cuda.manual_seed(0)
    ref = torch.rand(8, device=dev)
    torch.cuda.manual_seed(0)
    cpu_before = torch.get_rng_state()
    with t.fork():
        a = torch.rand(8, device=dev)
    assert torch.equal(torch.get_rng_state(), cpu_before)  # only the device's generator swaps
    assert torch.equal(torch.rand(8, device=dev), ref)
    g = torch.Generator(device=dev).manual_seed(3 + 2718 + 1)
    assert torch.equal(a, torch.rand(8, device=dev, generator=g))

    drop = TensorParallelRegionDropout(p=0.3, rng_tracker=t)
    lin = nn.Linear(32, 32, device=dev)

    def fn(x):
        h = drop(lin(F.dropout(x, 0.2)))
        q = h.view(2, 2, 4, 8)  # 4 x 32 values as (batch, heads, seq, head dim)
        with t.fork():
            h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).reshape(4, 32)
        return F.dropout(h, 0.2)

    results = []
    for use_ckpt in (False, True):
        lin.zero_grad()
        torch.manual_seed(1)
        t.seed(1)
        x = torch.randn(4, 32, device=dev, requires_grad=True)
        out = checkpoint(fn, x, rng_tracker=t) if use_ckpt else fn(x)
        torch.rand(5, device=dev)
        with t.fork():
            torch.rand(5, device=dev)
        out.square().sum().backward()
        results.append((out, x.grad, lin.weight.grad.clone(), t.get_state()["model_parallel_rng_state"]))
    for a, b in zip(*results):
        assert torch.equal(a, b)
