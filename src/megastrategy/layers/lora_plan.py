"""Tensor parallelism for PEFT LoRA layers, Megatron's way: the adapter follows its base layer.

A LoRA layer computes ``base(x) + B(A(dropout(x))) * scaling``. Where the declared plan splits
the base layer's output (``colwise``), ``A`` stays whole (it reads the whole input) and ``B`` is
column-parallel too, so both terms are the rank's slice of the output; ``B``'s own input copy
sums the gradient of ``A``'s output over the ranks, which makes ``A``'s gradient whole. Where the
base layer reads a split input (``rowwise``), ``A`` is row-parallel (its output summed over the
ranks) and ``B`` stays whole. Merging an adapter into the base weight then adds a delta of the
shard's shape. DoRA (its magnitude normalizes whole weight rows) and adapters that are not
``nn.Linear`` are refused with what works.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from megastrategy.layers.unit_types import is_linear_layer

__all__ = ["LORA_ADVICE", "is_lora_layer", "lora_members", "lora_unsupported"]

LORA_ADVICE = ("Use plain LoRA adapters on linear layers, fine-tune under pp and dp, or merge the adapters first "
               "(model.merge_and_unload()) to shard the plain model with tp.")


def is_lora_layer(m: nn.Module) -> bool:
    """A PEFT LoRA layer: an ``nn.Linear`` in ``base_layer`` with adapters beside it."""
    return is_linear_layer(getattr(m, "base_layer", None)) and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)


def lora_unsupported(m: nn.Module) -> str:
    """Why the LoRA layer ``m`` cannot be sharded exactly ("" when it can)."""
    if any(getattr(m, "use_dora", {}).values()):
        return "it is a PEFT DoRA layer, whose magnitude vector normalizes whole weight rows across the shards"
    adapters = list(m.lora_A.values()) + list(m.lora_B.values())
    if not all(type(a) is nn.Linear for a in adapters):
        return "it is a PEFT LoRA layer whose adapters are not plain nn.Linear layers"
    return ""


def lora_members(name: str, m: nn.Module, style: str, extra: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """The plan entries of LoRA layer ``name`` whose base layer takes ``style`` (column/row)."""
    members = [(f"{name}.base_layer", style, dict(extra))]
    sharded = "lora_B" if style == "column" else "lora_A"
    members += [(f"{name}.{sharded}.{adapter}", style, {}) for adapter in getattr(m, sharded)]
    return members
