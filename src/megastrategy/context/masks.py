"""Which keys a block of queries may see, from global positions only.

Masks are decided per pair of chunks (runs of consecutive global positions), so a pair that is
entirely hidden (a later key chunk under a causal mask, or one outside a sliding window) is
skipped without any compute, and a pair that is entirely visible needs no mask tensor. The
rules are the single-device ones: causal ``k <= q``; sliding window ``q - k < window`` (a key
is visible while it is fewer than ``window`` positions back); padding hides keys whose
attention-mask entry is 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megastrategy.context.layout import Chunk

HIDDEN, VISIBLE, PARTIAL = "hidden", "visible", "partial"


@dataclass(frozen=True)
class MaskRule:
    causal: bool
    window: Optional[int] = None
    key_padding: Optional[torch.Tensor] = None  # (batch, global seq) bool, True = real token


def visibility(q: Chunk, k: Chunk, rule: MaskRule) -> str:
    """HIDDEN, VISIBLE or PARTIAL for every (query, key) pair of the two chunks, ignoring padding."""
    if rule.causal and k.start > q.stop - 1:
        return HIDDEN
    if rule.window is not None and q.start - (k.stop - 1) >= rule.window:
        return HIDDEN
    causal_ok = not rule.causal or k.stop - 1 <= q.start
    window_ok = rule.window is None or (q.stop - 1) - k.start < rule.window
    return VISIBLE if causal_ok and window_ok else PARTIAL


def position_mask(q: Chunk, k: Chunk, rule: MaskRule, device=None) -> torch.Tensor:
    """``(len(q), len(k))`` bool, True where the query may see the key."""
    q_pos = torch.arange(q.start, q.stop, device=device)[:, None]
    k_pos = torch.arange(k.start, k.stop, device=device)[None, :]
    allowed = torch.ones(q.length, k.length, dtype=torch.bool, device=device)
    if rule.causal:
        allowed &= k_pos <= q_pos
    if rule.window is not None:
        allowed &= k_pos > q_pos - rule.window
    return allowed


def pair_mask(q: Chunk, k: Chunk, rule: MaskRule, device=None):
    """``(skip, mask)``: skip the pair entirely, or attend with ``mask`` (None = everything visible).

    The mask broadcasts against scores shaped ``(batch, kv_heads, group, q_len, k_len)``.
    """
    seen = visibility(q, k, rule)
    if seen == HIDDEN:
        return True, None
    mask = position_mask(q, k, rule, device) if seen == PARTIAL else None
    if rule.key_padding is not None:
        keys = rule.key_padding[:, k.start : k.stop].to(device=device, dtype=torch.bool)
        keys = keys[:, None, None, None, :]
        mask = keys if mask is None else mask & keys
    return False, mask
