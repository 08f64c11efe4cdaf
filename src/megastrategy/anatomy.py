"""The model's anatomy, computed once: where the layer stack is, what runs before and after it,
and which parameters the two sides share (a tied embedding).

Tensor parallelism, sequence parallelism, recompute, pipeline cuts and CUDA graphs all reason
about the same stack of identical blocks. This module sits below ``layers/`` and ``pipeline/``
so every component can be handed one :class:`ModelAnatomy` instead of searching again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["ModelAnatomy", "OutsideModule", "find_layer_stack", "get_submodule_path", "outside_modules"]


def get_submodule_path(module: nn.Module, path: str) -> nn.Module:
    """``module``'s submodule at dotted ``path`` (``pipeline_layers``), or an error saying what to give."""
    m = module
    for part in path.split("."):
        if not hasattr(m, part):
            raise MegatronConfigError(
                f"pipeline_layers={path!r}: {type(m).__name__} has no attribute {part!r}. "
                "Give the dotted path (from the LightningModule) of the nn.ModuleList that holds the blocks, "
                "e.g. 'model.bert.encoder.layer'."
            )
        m = getattr(m, part)
    return m


def find_layer_stack(module: nn.Module, pipeline_layers: Optional[str] = None) -> tuple[str, nn.ModuleList]:
    """The dotted path and the ``nn.ModuleList`` of blocks to split over pipeline stages.

    Without ``pipeline_layers`` this is the longest ``ModuleList`` whose entries are all of one type.
    """
    if pipeline_layers is not None:
        stack = get_submodule_path(module, pipeline_layers)
        if not isinstance(stack, nn.ModuleList):
            raise MegatronConfigError(
                f"pipeline_layers={pipeline_layers!r} is a {type(stack).__name__}, not an nn.ModuleList; "
                "point it at the list of transformer blocks (for example 'model.bert.encoder.layer')."
            )
        return pipeline_layers, stack
    best: tuple[str, nn.ModuleList] | None = None
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(b) for b in m}) == 1:
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    if best is None:
        raise MegatronConfigError(
            f"{type(module).__name__} has no nn.ModuleList of identical blocks to split over pipeline stages; "
            "keep the transformer blocks in an nn.ModuleList and pass its path as pipeline_layers='...'."
        )
    return best


@dataclass(frozen=True)
class OutsideModule:
    """A maximal subtree with parameters registered before or after the stack."""

    name: str
    parent: nn.Module
    module: nn.Module
    attr: str


def outside_modules(root: nn.Module, stack_path: str) -> tuple[list[OutsideModule], list[OutsideModule]]:
    """(pre, post): the parameter-holding subtrees registered before/after the stack.

    Registration order is the contract: what is registered before the stack runs before it.
    Parameter-free modules (dropout, rotary tables) are in neither list: they run everywhere.
    """
    pre: list[OutsideModule] = []
    post: list[OutsideModule] = []
    parent, prefix = root, ""
    for part in stack_path.split("."):
        seen_path_child = False
        for attr, child in parent._modules.items():
            if child is None:
                continue
            if attr == part:
                seen_path_child = True
                continue
            if any(True for _ in child.parameters()):
                (post if seen_path_child else pre).append(OutsideModule(f"{prefix}{attr}", parent, child, attr))
        parent, prefix = getattr(parent, part), f"{prefix}{part}."
    return pre, post


@dataclass
class ModelAnatomy:
    """The layer stack, the modules before/after it, and their shared (tied) parameters."""

    stack_path: str
    stack: nn.ModuleList
    pre: list[OutsideModule]
    post: list[OutsideModule]
    tied_parameters: list[nn.Parameter]

    @classmethod
    def of(cls, module: nn.Module, pipeline_layers: Optional[str] = None) -> "ModelAnatomy":
        path, stack = find_layer_stack(module, pipeline_layers)
        pre, post = outside_modules(module, path)
        pre_params = {id(p) for o in pre for p in o.module.parameters()}
        tied = [p for o in post for p in o.module.parameters() if id(p) in pre_params]
        return cls(stack_path=path, stack=stack, pre=pre, post=post, tied_parameters=tied)

    @classmethod
    def find(cls, module: nn.Module, pipeline_layers: Optional[str] = None) -> Optional["ModelAnatomy"]:
        """The anatomy, or ``None`` for a model without a stack of identical blocks (fine at pp=1)."""
        try:
            return cls.of(module, pipeline_layers)
        except MegatronConfigError:
            if pipeline_layers is not None:
                raise
            return None
