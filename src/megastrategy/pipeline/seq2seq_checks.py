"""What an encoder-decoder's pipeline needs besides the cut: its refusals, and the sum of the
gradients of a weight several stages hold when the seam stage is neither the first nor the last.

T5 and BART tie one embedding three ways: the encoder's embeddings (first stage), the decoder's
(the seam stage, which holds decoder block 0) and ``lm_head`` (last stage). With the seam on the
first or last stage the embedding group (first and last stage) sums them, as for a decoder-only
model. Otherwise a middle stage holds a copy too: the sum then runs over the whole pipeline group,
the stages without a copy adding zeros, so that every copy gets what the one device's single
parameter gets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.forward_order import loop_state_refusal
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.seq2seq_layout import Seq2SeqLayout
from megastrategy.pipeline.seq2seq_stage import held_modules

__all__ = ["Seq2SeqTied", "refuse_seq2seq_layout", "refuse_seq2seq_loop_state"]


def refuse_seq2seq_layout(layout: Seq2SeqLayout, pipeline_layers: Optional[str]) -> None:
    """Refuse a stack the user names: the joined stack is the encoder-decoder's own."""
    if pipeline_layers is not None:
        raise MegatronConfigError(
            f"pipeline_layers={pipeline_layers!r} with an encoder-decoder: the pipeline joins its two stacks "
            f"({layout.encoder_path} then {layout.decoder_path}) itself. Leave pipeline_layers unset.")


def refuse_seq2seq_loop_state(layout: Seq2SeqLayout, assignment: list[list[list[int]]], pp: int) -> None:
    """A stage may not start at a block that the forward's loop hands a plain value computed from the
    blocks before (see :func:`~.forward_order.loop_state_refusal`), in either stack."""
    n = layout.num_encoder
    starts = [chunk[0] for chunks in assignment for chunk in chunks]
    for order, path, local in ((layout.orders[0], layout.encoder_path, [s for s in starts if s < n]),
                               (layout.orders[1], layout.decoder_path, [s - n for s in starts if s > n])):
        refusal = loop_state_refusal(order, path, [[[s] for s in local]])
        if refusal is not None:
            raise MegatronConfigError(f"pp={pp}: {refusal}")


@dataclass
class Seq2SeqTied:
    """Every parameter several ranks hold, in one order on all ranks: this rank's copy or its shape."""

    entries: list[tuple[Optional[nn.Parameter], torch.Size]]
    beyond_ends: bool  # some copy is on a rank other than the first and last stage's
    device: torch.device

    @classmethod
    def build(cls, layout: Seq2SeqLayout, assignment: list[list[list[int]]], placement: StagePlacement,
              pp_rank: int) -> "Seq2SeqTied":
        modules = {o.name: o.module for o in layout.pre + layout.between + layout.post}
        holders: dict[int, set[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for rank, chunks in enumerate(assignment):
            stages = [placement.stage(rank, c) for c in range(len(chunks))]
            names = held_modules(layout, [(c[0], c[-1]) for c in chunks], 0 in stages, placement.num_stages - 1 in stages)
            for name in sorted(names):
                for p in modules[name].parameters():
                    params.setdefault(id(p), p)
                    holders.setdefault(id(p), set()).add(rank)
        ends = {placement.rank_of(0), placement.rank_of(placement.num_stages - 1)}
        shared = [pid for pid in params if len(holders[pid]) > 1 and params[pid].requires_grad]
        entries = [(params[pid] if pp_rank in holders[pid] else None, params[pid].shape) for pid in shared]
        device = next((p.device for p in params.values()), torch.device("cpu"))
        return cls(entries, any(holders[pid] - ends for pid in shared), device)

    def all_reduce(self, group) -> None:
        """Sum every copy's ``main_grad`` over ``group`` (the pipeline group), in float32, in one call."""
        if not self.entries:
            return
        parts = [p.main_grad.float().reshape(-1) if p is not None else torch.zeros(shape.numel(), device=self.device)
                 for p, shape in self.entries]
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=group)
        offset = 0
        for p, shape in self.entries:
            if p is not None:
                p.main_grad.copy_(flat[offset:offset + shape.numel()].view_as(p.main_grad))
            offset += shape.numel()
