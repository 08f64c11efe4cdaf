"""PEFT LoRA adapters under sequence parallelism: which adapter weights sum their gradient over TP.

A LoRA layer adds ``B(A(x))`` to its base layer's output, and under tp the adapter half that the
plan shards follows the base layer (:mod:`megastrategy.layers.lora_plan`): ``B`` of a column base
is column-parallel, ``A`` of a row base row-parallel, so sequence parallelism gives them the
base's collectives (gather the sequence before a column layer, reduce-scatter after a row one).
The other half stays whole on every rank and then sees only part of the work:

* ``A`` of a column base reads the block's sequence-split input, or, inside an attention module
  whose input is gathered once, receives from the pre-gathered ``B`` only this rank's share of
  the gradient of its output;
* ``B`` of a row base reads the reduce-scattered, sequence-split output of ``A`` (the residual
  layout); in the norms layout row layers keep their all-reduce and ``B`` sees every token.

Either way its weight gradient is this rank's part of one device's, so it is summed over TP
before the step, as a layer norm's is.
"""
from __future__ import annotations

from typing import Iterator

from torch import nn

__all__ = ["lora_adapter_layers", "sharded_column_adapters", "whole_adapter_params"]


def lora_adapter_layers(block: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Each PEFT LoRA layer in ``block`` with the side its base layer was sharded on
    (``"column"``: the base splits its output; ``"row"``: its input)."""
    from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear

    for m in block.modules():  # sharded already: the base layer is no longer an nn.Linear
        if not isinstance(getattr(m, "lora_A", None), nn.ModuleDict):
            continue
        base = getattr(m, "base_layer", None)
        if isinstance(base, ColumnParallelLinear):
            yield m, "column"
        elif isinstance(base, RowParallelLinear):
            yield m, "row"


def whole_adapter_params(block: nn.Module, row_split: bool) -> Iterator[nn.Parameter]:
    """The parameters of the adapters that stay whole and run on split tokens or partial gradients:
    every column layer's ``A``; every row layer's ``B`` when row layers reduce-scatter (``row_split``)."""
    for m, side in lora_adapter_layers(block):
        if side == "column":
            yield from m.lora_A.parameters()
        elif row_split:
            yield from m.lora_B.parameters()


def sharded_column_adapters(block: nn.Module) -> set[int]:
    """Ids of the column-parallel ``B`` adapters in ``block``: fed ``A``'s output, not a norm's."""
    return {id(b) for m, side in lora_adapter_layers(block) if side == "column" for b in m.lora_B.values()}
