"""Global token positions for models that number positions themselves.

The input hook passes every rank's global positions to the outermost module that takes
``position_ids`` when it got none. Two kinds of model number positions differently, and
each silently used the wrong positions at cp2 (the sweep, docs/sweeps/causal_lm_cp2.md):

* **Numbered from the padding index** (RoBERTa and its descendants): the position table has a
  ``padding_idx`` and the model numbers real tokens ``padding_idx + 1, + 2, ...`` from the
  input ids (padding keeps ``padding_idx``). 0-based positions were off by ``padding_idx + 1``
  (1.2e-2 .. 1.7e-2 loss difference). The same rule is applied to the *global* ids before the
  split: :func:`padding_numbered_positions`.
* **Numbered from the local length inside the model** (BART-family decoders build
  ``arange(seq_len)`` and hand it to their position table): the hook sees ``position_ids``
  that are a run ``c, c+1, ...`` of the local length. The rank's global positions are a run
  only when its chunks are adjacent (the contiguous layout; the middle rank of the balanced
  one), and then it starts at the rank's first global position, which a run numbered from 0
  starts below. Such a run is replaced by ``c +`` the global positions:
  :func:`globalize` (BART 3.4e-2, Pegasus 6.7e-3 off before).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn


def padding_index_numbering(model: nn.Module) -> Optional[int]:
    """The padding index a position table numbers from (a ``position_embeddings`` embedding with a
    ``padding_idx``), or None when positions are 0-based."""
    for module in model.modules():
        table = getattr(module, "position_embeddings", None)
        if isinstance(table, nn.Embedding) and table.padding_idx is not None:
            return int(table.padding_idx)
    return None


def padding_numbered_positions(batch: Any, padding_idx: int, seq_len: int) -> Optional[torch.Tensor]:
    """``(batch, seq)`` positions numbered from ``padding_idx`` on the whole sequence, as the model
    numbers them on one device: real tokens count up from ``padding_idx + 1``, padding keeps it."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == seq_len:
        real = (ids != padding_idx).long()
        return torch.cumsum(real, dim=1) * real + padding_idx
    embeds = batch.get("inputs_embeds") if isinstance(batch, Mapping) else None
    if isinstance(embeds, torch.Tensor):
        return (torch.arange(seq_len, device=embeds.device) + padding_idx + 1)[None].expand(embeds.shape[0], -1)
    return None


def globalize(position_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``position_ids`` with every locally numbered run ``c + arange(local)`` replaced by ``c + positions``
    (the rank's global positions); anything else is returned unchanged."""
    local = positions.shape[-1]
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != local or local < 2:
        return position_ids
    start = position_ids[..., :1]
    if not bool((position_ids - start == torch.arange(local, device=position_ids.device)).all()):
        return position_ids
    positions = positions.to(position_ids.device)
    consecutive = bool((positions.diff() == 1).all())
    if consecutive and bool((start >= positions[0]).any()):
        return position_ids  # already global (contiguous layout), or numbered by the user
    return start + positions
