"""Activation memory of a 1F1B pipeline step: bounded by pp, not by num_microbatches.

Real gloo processes run :class:`PipelineExecutor` over a small transformer-like stack;
the bytes autograd saves for backward are counted with ``saved_tensors_hooks`` (a saved
tensor counts from the forward that packs it until autograd frees it after its backward;
parameters are not activations and are left out). For every rank the peak must be the
same for M = 4, 8 and 16 microbatches and equal (pp - rank) times one microbatch's
activations (rank 0 holds pp microbatches); ``"full"`` recomputation keeps only the
blocks' inputs and lowers the peak, still independently of M.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megastrategy.pipeline import schedule_steps
from megastrategy.pipeline.executor import PipelineExecutor
from megastrategy.pipeline.p2p import PipelineCommunicator
from tests.helpers.dist import run_distributed

HIDDEN, SEQ, MB = 16, 8, 2
BLOCKS_PER_STAGE = 2
MICROBATCHES = (4, 8, 16)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc, self.out = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.out(F.gelu(self.fc(self.ln(x)))))


class Stage(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS_PER_STAGE))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class LiveSavedBytes:
    """Counts the bytes of live saved activations (and their peak) while active."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = 0
        self.peak = 0
        self.packed = 0

    def _pack(self, t):
        if t.untyped_storage().data_ptr() in self.params:
            return t
        return _Holder(self, t)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Holder) else h

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _Holder:
    __slots__ = ("owner", "t", "n")

    def __init__(self, owner, t):
        self.owner, self.t, self.n = owner, t, t.numel() * t.element_size()
        owner.live += self.n
        owner.packed += self.n
        owner.peak = max(owner.peak, owner.live)

    def __del__(self):
        self.owner.live -= self.n


def _one_config(comm, pp, stage, M, recompute):
    from megastrategy.layers.random import ModelParallelRNGTracker
    from megastrategy.layers.recompute import apply_activation_checkpointing

    model = Stage(seed=100 + stage)
    model.train()
    if recompute:
        tracker = ModelParallelRNGTracker(tp_rank=0, device="cpu")
        tracker.seed(5)
        apply_activation_checkpointing(model, "full", rng_tracker=tracker)
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(MB, SEQ, HIDDEN, generator=gen) for _ in range(M)]
    meter = LiveSavedBytes(model.parameters())
    per_mb = []

    def forward_step(chunk, mb, inp):
        before = meter.packed
        with meter.hooks():
            x = model(inputs[mb] if stage == 0 else inp)
            out = x.square().mean() if stage == pp - 1 else x
        per_mb.append(meter.packed - before)
        return out

    torch.manual_seed(11 + stage)
    ex = PipelineExecutor(comm, pp_size=pp, pp_rank=stage)
    losses = ex.run(schedule_steps(M, pp, stage), forward_step=forward_step, num_microbatches=M, loss_scale=1.0 / M)
    grads = [p.grad.clone() for p in model.parameters()]
    assert len(set(per_mb)) == 1, per_mb  # every microbatch saves the same
    assert meter.live == 0, "saved activations outlived the step"
    return {
        "peak": meter.peak,
        "per_mb": per_mb[0],
        "in_flight": ex.peak_in_flight,
        "losses": [float(x) for x in losses],
        "grads": grads,
    }


def _worker(rank, world):
    g4 = dist.new_group([0, 1, 2, 3])
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for pp in (4, 2):
        ranks = [0, 1, 2, 3] if pp == 4 else ([0, 1] if rank < 2 else [2, 3])
        group = g4 if pp == 4 else g2[rank // 2]
        stage = ranks.index(rank)
        comm = PipelineCommunicator(pp_group=group, pp_ranks=ranks, pp_rank=stage, device="cpu")
        for M in MICROBATCHES:
            for recompute in (False, True):
                r = _one_config(comm, pp, stage, M, recompute)
                out[(pp, M, recompute)] = r
            plain, rc = out[(pp, M, False)], out[(pp, M, True)]
            # recomputation changes memory, not results (dropout replayed)
            assert plain["losses"] == rc["losses"]
            assert all(torch.equal(a, b) for a, b in zip(plain["grads"], rc["grads"]))
        comm.wait_all()
    dist.barrier()
    return {k: {kk: v for kk, v in r.items() if kk != "grads"} for k, r in out.items()}, rank


def test_1f1b_activation_memory_grows_with_pp_not_microbatches_and_recompute_lowers_it():
    results = run_distributed(_worker, 4, timeout=300)
    for report, rank in results:
        for pp in (4, 2):
            stage = rank if pp == 4 else rank % 2
            in_flight = pp - stage
            for recompute in (False, True):
                peaks = {report[(pp, M, recompute)]["peak"] for M in MICROBATCHES}
                assert len(peaks) == 1, (rank, pp, recompute, peaks)  # independent of num_microbatches
                r = report[(pp, MICROBATCHES[0], recompute)]
                assert r["in_flight"] == in_flight
                assert r["peak"] == in_flight * r["per_mb"], (rank, pp, recompute, r)
            plain, rc = report[(pp, 16, False)], report[(pp, 16, True)]
            assert rc["peak"] < plain["peak"] / 3, (rank, pp, plain["peak"], rc["peak"])
        # the first stage holds pp microbatches: twice as much at pp=4 as at pp=2
        if rank == 0:
            assert report[(4, 16, False)]["peak"] == 2 * report[(2, 16, False)]["peak"]
            assert report[(4, 16, True)]["peak"] == 2 * report[(2, 16, True)]["peak"]
