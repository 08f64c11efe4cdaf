"""Which kinds of layer a plan can shard, and how each kind is described in error messages.

Every pass of the resolution asks the same questions of a module (is it a linear layer, what
are its features, which styles fit it); answering them in one place keeps the passes agreeing.
"""
from __future__ import annotations

from torch import nn

from megastrategy.layers.builtin_plans import is_conv1d

__all__ = ["type_name", "features", "is_linear", "is_weight_layer", "style_fits", "style_hint"]


def type_name(m: nn.Module) -> str:
    return type(m).__name__


def features(m: nn.Module) -> tuple[int, int]:
    """``(in, out)`` of an ``nn.Linear`` or HF ``Conv1D``."""
    if is_conv1d(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return int(m.in_features), int(m.out_features)


def is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def is_weight_layer(m: nn.Module) -> bool:
    return is_linear(m) or isinstance(m, (nn.Embedding, nn.MultiheadAttention))


def style_fits(style: str, m: nn.Module) -> bool:
    if style == "column":
        return is_linear(m) or isinstance(m, nn.Dropout)
    if style == "row":
        return is_linear(m)
    if style == "vocab":
        return is_linear(m) or isinstance(m, nn.Embedding)
    return True


def style_hint(m: nn.Module) -> str:
    if isinstance(m, nn.Embedding):
        return "an nn.Embedding takes 'vocab' or 'replicate'"
    if is_linear(m):
        return "a linear layer takes 'column', 'row', 'vocab' (output = vocabulary) or 'replicate'"
    if isinstance(m, nn.Dropout):
        return "an nn.Dropout takes 'column' (acts on column-sharded activations) or 'replicate'"
    if isinstance(m, nn.MultiheadAttention):
        return "an nn.MultiheadAttention takes 'auto' (sharded by heads) or 'replicate'"
    return (
        f"a container ({type_name(m)}) takes only 'replicate' or 'auto'; name its nn.Linear/"
        "nn.Embedding children instead (narrow the glob, e.g. end it with the layer's attribute name)"
    )
