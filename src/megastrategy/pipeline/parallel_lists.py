"""Refuse a layer stack whose blocks are spread over parallel lists indexed together.

XLM and Flaubert keep layer ``i`` as ``attentions[i]``, ``layer_norm1[i]``, ``ffns[i]`` and
``layer_norm2[i]``: four ``ModuleList``s of one length under one parent, read with the same index
in one loop (PoolFormer zips ``patch_embeddings`` with ``block``). A pipeline stage cuts one list
into its local blocks, so the other lists' entries (whole on every stage) no longer line up: the step
crashed with an IndexError. No single list holds whole blocks, so this is refused in setup.
"""
from __future__ import annotations

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_parallel_lists"]


def parallel_lists(parent: nn.Module, stack_attr: str, length: int) -> list[str]:
    """The other ``ModuleList`` children of ``parent`` as long as the stack (more than one block)."""
    if length < 2:
        return []
    return [name for name, child in parent.named_children()
            if name != stack_attr and isinstance(child, nn.ModuleList) and len(child) == length]


def refuse_parallel_lists(module: nn.Module, stack_path: str, pp: int) -> None:
    parent_path, _, attr = stack_path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    stack = getattr(parent, attr)
    others = parallel_lists(parent, attr, len(stack))
    if not others:
        return
    lists = ", ".join(repr(f"{parent_path}.{n}" if parent_path else n) for n in [attr, *others])
    raise MegatronConfigError(
        f"pp={pp}: the blocks of {type(parent).__name__} are spread over parallel lists of {len(stack)} entries "
        f"({lists}) that the forward indexes together, so no one list holds whole blocks and a pipeline stage "
        f"cannot cut them (another list's entry i would not be this stage's block i). Use pp=1 for this model "
        f"(tensor and data parallelism work), or keep each block's parts in one module of one nn.ModuleList."
    )
