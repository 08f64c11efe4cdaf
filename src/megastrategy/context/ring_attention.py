"""Exact attention over the whole sequence when each rank holds only its part of it.

K/V blocks travel around the context-parallel ring; at every step a rank attends its queries to
the block it holds (skipping chunk pairs the mask hides) while the next block is already in
flight, and merges the partial results with an online softmax. Backward runs the same ring:
K/V rotate again, and each block's dK/dV accumulator travels with it, collecting every rank's
contribution before a final hop delivers it to the block's owner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megastrategy.context.block_attention import NEG_INF, block_backward, block_forward, merge
from megastrategy.context.layout import SequenceLayout
from megastrategy.context.masks import MaskRule, pair_mask
from megastrategy.context.ring import TAG_GRAD_KV, TAG_KV, Ring


@dataclass(frozen=True)
class RingPlan:
    ring: Ring
    layout: SequenceLayout
    rule: MaskRule
    scale: float
    softcap: Optional[float] = None  # Gemma 2's attention logit soft-capping

    def pairs(self, source: int, device):
        """``(query chunk, key chunk, mask)`` for every chunk pair with something visible."""
        for q_chunk in self.layout.chunks(self.ring.rank):
            for k_chunk in self.layout.chunks(source):
                skip, mask = pair_mask(q_chunk, k_chunk, self.rule, device)
                if not skip:
                    yield q_chunk, k_chunk, mask


def _rows(chunk) -> slice:
    return slice(chunk.local_start, chunk.local_start + chunk.length)


def ring_forward(q, k, v, plan: RingPlan):
    ring = plan.ring
    # values may be narrower or wider than queries/keys (multi-head latent attention: 8 vs 12)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
    kv = [k, v]
    for step in range(ring.size):
        pending = ring.start(kv, TAG_KV) if step < ring.size - 1 else None
        for q_chunk, k_chunk, mask in plan.pairs(ring.source(step), q.device):
            rows, keys = _rows(q_chunk), _rows(k_chunk)
            block_out, block_lse = block_forward(
                q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], mask, plan.scale, plan.softcap
            )
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
        if pending is not None:
            kv = pending.wait()
    return out, lse


def ring_backward(q, k, v, out, lse, dout, plan: RingPlan, dlse=None):
    """``dlse``: the gradient reaching the log-sum-exp (attention sinks use it); a score's gradient
    is ``P·(dP − delta)`` plus ``dlse·P``, i.e. ``delta`` lowered by ``dlse``."""
    ring = plan.ring
    delta = (dout.float() * out.float()).sum(dim=-1)
    if dlse is not None:
        delta = delta - dlse.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, grad_pending = [k, v], None
    for step in range(ring.size):
        kv_pending = ring.start(kv, TAG_KV) if step < ring.size - 1 else None
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for q_chunk, k_chunk, mask in plan.pairs(ring.source(step), q.device):
            rows, keys = _rows(q_chunk), _rows(k_chunk)
            block_dq, block_dk, block_dv = block_backward(
                q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :],
                dout[..., rows, :], lse[..., rows], delta[..., rows], mask, plan.scale, plan.softcap,
            )
            dq[..., rows, :] += block_dq
            dk[..., keys, :] += block_dk
            dv[..., keys, :] += block_dv
        if grad_pending is not None:
            dk_in, dv_in = grad_pending.wait()
            dk, dv = dk + dk_in, dv + dv_in
        if ring.size > 1:
            grad_pending = ring.start([dk, dv], TAG_GRAD_KV)
        if kv_pending is not None:
            kv = kv_pending.wait()
    if grad_pending is not None:
        dk, dv = grad_pending.wait()
    return dq, dk, dv


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves only q, k, v, the output and its log-sum-exp; returns both (the
    log-sum-exp is differentiable: attention sinks rescale the output with it)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        out, lse = ring_forward(q, k, v, plan)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, dout, ctx.plan, dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(query, key, value, plan: RingPlan, sinks=None) -> torch.Tensor:
    """Attention for ``(batch, heads, local_len, dim)`` tensors; K/V may have fewer heads (GQA).

    ``sinks`` (one logit per query head, GPT-OSS's attention sinks): an extra key with no value in
    every row's softmax, so the output is the ring's times ``Z / (Z + e^sink)`` = ``sigmoid(lse - sink)``.
    """
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, length, dim)
    out, lse = RingAttentionFunction.apply(grouped, key.contiguous(), value.contiguous(), plan)
    out = out.reshape(batch, heads, length, value.shape[-1])
    if sinks is None:
        return out
    kept = torch.sigmoid(lse.reshape(batch, heads, length) - sinks.float().reshape(1, heads, 1))
    return (out.float() * kept[..., None]).to(out.dtype)
