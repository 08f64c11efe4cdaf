"""Route the user's attention calls to ring attention while a microbatch is split.

Two entry points, both with the caller's own signature: the Hugging Face attention interface
(``module, query, key, value, attention_mask, ...``, returning ``(output, weights)`` with the
sequence before the heads) and ``F.scaled_dot_product_attention``. Anything that would make the
split inexact (dropout on attention probabilities, a position bias, a custom mask
tensor, keys that are not the local sequence) is refused with what would work instead.
Attention sinks (``s_aux``/``sinks``) are applied exactly from the ring's log-sum-exp, and
soft-capping (``softcap``) on every block's scores.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megastrategy.context.hf_masks import MaskMarkers, classify
from megastrategy.context.masks import MaskRule
from megastrategy.context.microbatch import MicrobatchState
from megastrategy.context.ring import Ring
from megastrategy.context.ring_attention import RingPlan, ring_attention
from megastrategy.errors import MegatronConfigError

UNSUPPORTED_HF_KWARGS = ("position_bias", "attention_chunk_size")
SINK_KWARGS = ("s_aux", "sinks")  # one logit per head joining every row's softmax (GPT-OSS)


@dataclass
class ActiveSplit:
    """What the dispatch needs while one microbatch's forward runs."""

    state: MicrobatchState
    ring: Ring
    where: str = "the model"  # the module running now, for error messages
    stack: list = field(default_factory=list)
    masks: MaskMarkers = field(default_factory=MaskMarkers)  # the Hugging Face masks built in this forward

    def plan(self, causal: bool, window: Optional[int], padding: bool, scale: float, softcap=None) -> RingPlan:
        rule = MaskRule(causal, window, self.state.key_padding if padding else None)
        return RingPlan(self.ring, self.state.layout, rule, scale, softcap)

    def check_local(self, query: torch.Tensor, key: torch.Tensor, caller: str) -> None:
        local = self.state.layout.local_len
        if query.shape[-2] != local or key.shape[-2] != local:
            raise MegatronConfigError(
                f"{caller} in {self.where}: query length {query.shape[-2]} and key length {key.shape[-2]}, but the "
                f"local sequence has {local} tokens. Context parallelism splits self-attention over the input "
                "sequence; cross-attention, KV caches and attention over other axes cannot be split."
            )

    def refuse_dropout(self, p: float, caller: str) -> None:
        if p and p > 0:
            raise MegatronConfigError(
                f"{caller} in {self.where} uses attention dropout p={p}: dropout on the attention probabilities "
                "cannot be reproduced block by block over cp ranks. Set the attention dropout to 0 "
                "(e.g. attention_dropout=0.0 / attention_probs_dropout_prob=0.0)."
            )


def hf_mask(split: ActiveSplit, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
            mask_function=None, **kwargs) -> torch.Tensor:
    """Hugging Face mask-interface function: a marker for the rule of ``mask_function`` on the global
    sequence (see hf_masks); padding comes from the split's whole attention mask, not the local one."""
    from transformers.masking_utils import causal_mask_function

    rule = classify(mask_function or causal_mask_function, split.state.layout.seq_len, split.where)
    return split.masks.make(rule, batch_size, q_length, device=split.state.positions.device)


def hf_attention(split: ActiveSplit, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 sliding_window=None, is_causal=None, **kwargs):
    """Hugging Face attention-interface function; masks come from the split: the rule of the mask the
    model built (a marker from :func:`hf_mask`), else the module's ``is_causal``/``sliding_window``."""
    split.refuse_dropout(dropout, "Hugging Face attention")
    used = [name for name in UNSUPPORTED_HF_KWARGS if kwargs.get(name) is not None]
    if used:
        raise MegatronConfigError(f"attention in {split.where} passes {used}, which ring attention does not implement.")
    rule = split.masks.rule_of(attention_mask) if attention_mask is not None else None
    if attention_mask is not None and rule is None:
        raise MegatronConfigError(
            f"attention in {split.where} received a prepared {tuple(attention_mask.shape)} mask tensor: with cp > 1 "
            "pass a 2-D padding attention_mask (batch, sequence) and let the model's causal/window rules apply."
        )
    split.check_local(query, key, "Hugging Face attention")
    if rule is not None:
        causal, window = rule
    else:
        causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = next((kwargs[name] for name in SINK_KWARGS if kwargs.get(name) is not None), None)
    plan = split.plan(causal, window, padding=True, scale=scale, softcap=kwargs.get("softcap"))
    out = ring_attention(query, key, value, plan, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def sdpa_attention(split: ActiveSplit, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` over the whole sequence; the caller's mask must be None."""
    split.refuse_dropout(dropout_p, "scaled_dot_product_attention")
    if attn_mask is not None:
        raise MegatronConfigError(
            f"scaled_dot_product_attention in {split.where} got an attn_mask tensor: a mask built for the local "
            "sequence cannot describe keys on other cp ranks. Call it with is_causal=True (or no mask)."
        )
    split.check_local(query, key, "scaled_dot_product_attention")
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        raise ValueError("scaled_dot_product_attention: key heads differ from query heads but enable_gqa=False")
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    return ring_attention(query, key, value, split.plan(bool(is_causal), None, padding=False, scale=scale))
