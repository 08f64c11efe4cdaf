"""Split one microbatch's sequence dimension over the context-parallel ranks.

Everything that is laid out along the sequence (token ids, labels, attention and position
masks) is split with the same layout, so the user's ``training_step`` sees an ordinary, shorter
batch. What the split would lose is kept in a :class:`MicrobatchState`: the global positions of
the local tokens, the whole padding mask (keys on other ranks may be padding) and, for causal
language models, the labels shifted on the *global* sequence, so the token after a chunk
boundary is still the target of the token before it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megastrategy.context.layout import SequenceLayout
from megastrategy.context.positions import padding_numbered_positions
from megastrategy.errors import MegatronConfigError

SEQUENCE_KEYS = ("input_ids", "inputs_embeds")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class MicrobatchState:
    layout: SequenceLayout
    rank: int
    batch_size: int
    positions: torch.Tensor  # (local_len,) global positions of the local tokens
    key_padding: Optional[torch.Tensor]  # (batch, seq) bool over the whole sequence; None = no padding
    shift_labels: Optional[torch.Tensor]  # (batch, local_len) next-token targets from the global sequence
    training: bool
    row_positions: Optional[torch.Tensor] = None  # (batch, local_len) when positions are numbered per row

    @property
    def local_tokens(self) -> int:
        return self.batch_size * self.layout.local_len


def sequence_shape(batch: Any) -> tuple[int, int]:
    """``(batch size, sequence length)`` from ``input_ids``/``inputs_embeds`` or the first tensor with a
    sequence dimension."""
    if isinstance(batch, Mapping):
        for key in SEQUENCE_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return tuple(batch[key].shape[:2])
    for value in batch.values() if isinstance(batch, Mapping) else _iter(batch):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return tuple(value.shape[:2])
    raise MegatronConfigError(
        f"context parallelism found no tensor with a sequence dimension in the batch ({type(batch).__name__}); "
        "it splits tensors shaped (batch, sequence, ...), e.g. a dict with 'input_ids'."
    )


def _iter(batch: Any):
    if isinstance(batch, torch.Tensor):
        return [batch]
    return list(batch) if isinstance(batch, (list, tuple)) else []


def split_collection(batch: Any, layout: SequenceLayout, rank: int, shape: tuple[int, int]) -> Any:
    """The same collection with every ``(batch, sequence, ...)`` tensor replaced by its local part."""
    if isinstance(batch, torch.Tensor):
        splits = batch.dim() >= 2 and batch.shape[1] == shape[1] and batch.shape[0] in (shape[0], 1)
        return layout.split(batch, rank) if splits else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: split_collection(v, layout, rank, shape) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(split_collection(v, layout, rank, shape) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(split_collection(v, layout, rank, shape) for v in batch)
    return batch


def padding_mask(batch: Any) -> Optional[torch.Tensor]:
    """The whole ``(batch, seq)`` key-padding mask, or None when every token is real."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is None:
        return None
    if mask.dim() != 2:
        raise MegatronConfigError(
            f"attention_mask of shape {tuple(mask.shape)}: context parallelism takes a 2-D (batch, sequence) "
            "padding mask and builds causal/window masks itself; a custom 4-D mask cannot be split over ranks."
        )
    mask = mask.bool()
    return None if bool(mask.all()) else mask


def check_position_ids(batch: Any) -> None:
    """Position ids that restart inside a row mean packed sequences, which the ring does not mask."""
    ids = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if ids is not None and ids.shape[-1] > 1 and not bool((ids.diff(dim=-1) == 1).all()):
        raise MegatronConfigError(
            "position_ids that do not increase by 1 along the sequence (packed sequences) are not supported "
            "with cp > 1: the ring masks by global token position. Pass one sequence per row (pad instead of pack)."
        )


def global_shift_labels(batch: Any, layout: SequenceLayout, rank: int, shape) -> Optional[torch.Tensor]:
    """Labels shifted by one on the whole sequence, then split: the targets a causal LM loss needs."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.shape[1] != shape[1]:
        return None
    tail = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return layout.split(torch.cat([labels[:, 1:], tail], dim=1), rank)


def split_microbatch(batch: Any, kind: str, cp_size: int, rank: int, training: bool, causal_lm: bool,
                     padding_idx: Optional[int] = None):
    """``(local batch, state)`` for one microbatch; ``padding_idx``: the model numbers positions from it
    (see positions.py)."""
    shape = sequence_shape(batch)
    layout = SequenceLayout(kind, shape[1], cp_size)
    check_position_ids(batch)
    device = next((t.device for t in _tensors(batch)), None)
    state = MicrobatchState(
        layout=layout,
        rank=rank,
        batch_size=shape[0],
        positions=layout.positions(rank, device=device),
        key_padding=padding_mask(batch),
        shift_labels=global_shift_labels(batch, layout, rank, shape) if causal_lm else None,
        training=training,
        row_positions=_row_positions(batch, padding_idx, layout, rank),
    )
    return split_collection(batch, layout, rank, shape), state


def _row_positions(batch: Any, padding_idx: Optional[int], layout: SequenceLayout, rank: int):
    if padding_idx is None:
        return None
    numbered = padding_numbered_positions(batch, padding_idx, layout.seq_len)
    return None if numbered is None else layout.split(numbered, rank)


def _tensors(batch: Any):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)
