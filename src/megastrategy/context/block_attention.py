"""Attention of one query block against one key/value block, with its log-sum-exp.

The ring computes attention block by block; the online-softmax merge combines partial results
exactly because each carries its log-sum-exp (``lse``). Backward recomputes the block's
probabilities from the saved ``lse``, so no full attention matrix is ever stored.

Shapes: queries ``(batch, kv_heads, group, q_len, dim)`` (grouped-query attention keeps the
query heads that share a K/V head together), keys and values ``(batch, kv_heads, k_len, dim)``.
Everything is computed in float32. ``softcap`` (Gemma 2's ``attn_logit_softcapping``) bounds each
score as ``softcap · tanh(score / softcap)`` before the softmax, as the eager path does; the
backward multiplies by its derivative ``1 − tanh²``.
"""
from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")


def _scores(q, k, scale: float, softcap: Optional[float]):
    """``(scores, tanh)``: the block's (soft-capped) scores, and the tanh the backward needs (or None)."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q.float(), k.float()) * scale
    if not softcap:
        return scores, None
    capped = torch.tanh(scores / softcap)
    return capped * softcap, capped


def block_forward(q, k, v, mask: Optional[torch.Tensor], scale: float, softcap: Optional[float] = None):
    """``(out, lse)`` for one block: ``out`` normalised within the block; fully hidden rows give
    ``out = 0`` and ``lse = -inf`` so that they vanish in :func:`merge`."""
    scores, _ = _scores(q, k, scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.float()) / total.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (row_max + torch.log(total)).squeeze(-1)
    return out, lse


def _weight(lse: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """``exp(lse - merged)``, 0 where both are -inf (a row nothing was visible to, yet)."""
    safe = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    return torch.where(torch.isfinite(lse), torch.exp(lse - safe), torch.zeros_like(lse))


def merge(out, lse, block_out, block_lse):
    """Online-softmax combination of two partial attentions over disjoint key sets."""
    merged = torch.logaddexp(lse, block_lse)
    out = out * _weight(lse, merged)[..., None] + block_out * _weight(block_lse, merged)[..., None]
    return out, merged


def block_backward(q, k, v, dout, lse, delta, mask: Optional[torch.Tensor], scale: float,
                   softcap: Optional[float] = None):
    """``(dq, dk, dv)`` of one block, given the final ``lse`` and ``delta = rowsum(dout·out)``."""
    q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    scores, capped = _scores(q, k, scale, softcap)
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    probs = torch.exp(scores - lse[..., None])
    if mask is not None:
        probs = probs.masked_fill(~mask, 0.0)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, dout)
    dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dout, v)
    dscores = probs * (dprobs - delta[..., None])
    if capped is not None:
        dscores = dscores * (1 - capped * capped)
    dq = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q) * scale
    return dq, dk, dv
