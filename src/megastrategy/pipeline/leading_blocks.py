"""Placeholders for the blocks before a chunk, so the forward's loop counts blocks globally.

A chunk's view of the layer stack (:class:`megastrategy.pipeline.stage.LocalLayers`) holds only
its own blocks. Hugging Face decoders index per-layer settings by the loop counter:
``for i, layer in enumerate(self.layers[: config.num_hidden_layers])`` with
``attention_mask=masks[config.layer_types[i]]`` (GPT-OSS's alternating sliding/full layers,
Llama 4's chunked layers, Qwen3-Next's linear/full layers, Gemma 2/3...). A stage starting at
block 1 would run block 1 as ``i = 0``, with block 0's mask: wrong numbers, silently. So each
chunk's view starts with one :class:`SkippedBlock` per block before it.

A skipped block computes nothing: it hands its hidden-state input back, in the structure the
real blocks return (a bare tensor, a tuple or a plain dict whose other entries are ``None``: the dry run of the
forward, :mod:`.forward_order`, says which). Without a dry run (a module that is not a Hugging Face
model, or whose forward cannot run on the meta device) nothing is known of that structure, and the
view holds the chunk's blocks only, as before. Its value never reaches the computation: the chunk's
first real block takes the previous stage's activation instead (its pre-hook, with what a block
carries to the next, :mod:`.boundary_pack`). What the loop reads off a block (NemotronH's
``block_type``, which picks the mask) comes from a parameter-free meta copy of the real one.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from megastrategy.pipeline.forward_order import MetaAttributes, meta_copy

__all__ = ["SkippedBlock", "skipped_blocks"]


class SkippedBlock(MetaAttributes, nn.Module):
    """Block ``index`` on a chunk that starts after it: returns its input hidden state."""

    def __init__(self, index: int, real: nn.Module, arity: int | tuple[str, ...]):
        super().__init__()
        self.index = index
        self.arity = arity  # 0: the blocks return a bare tensor; n: a tuple of n outputs; keys: a dict
        self._meta = [meta_copy(real)]  # a list: not registered as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(self.arity, tuple):
            return {key: hidden if i == 0 else None for i, key in enumerate(self.arity)}
        if not self.arity:
            return hidden
        return (hidden,) + (None,) * (self.arity - 1)

    def extra_repr(self) -> str:
        return f"block {self.index}, skipped on this chunk"


def skipped_blocks(stack: nn.ModuleList, count: int, arity: Optional[int | tuple[str, ...]]) -> list[SkippedBlock]:
    """Placeholders for blocks ``0 .. count-1`` of ``stack``, shared by a rank's chunks (built
    before the stage registers its hooks, so the meta copies carry none); none when the blocks'
    output structure is unknown (``arity`` None)."""
    return [] if arity is None else [SkippedBlock(i, stack[i], arity) for i in range(count)]
