"""Built-in plan for timm's Vision Transformer blocks (``timm.models.vision_transformer``), which
are not Hugging Face models, so neither a declared plan nor structural detection reaches them.

timm's ``Attention`` runs ``qkv(x).reshape(B, N, 3, num_heads, head_dim)``: the fused projection
is ``[q | k | v]``, three equal sections, so it is column-parallel in 3 packed chunks; the forward
then reshapes the heads' output to ``attn_dim``, so both ``num_heads`` and ``attn_dim`` count
local heads (divided by tp). An attention with parameters between the projections (q/k norms, a
norm over the heads' output, a gate) is left to auto-detection's refusal: not reproduced exactly
here. timm's ``Mlp`` is ``fc1`` column, ``fc2`` row, its inner dropout on the local features.
"""
from __future__ import annotations

from typing import Iterable

from torch import nn

from megastrategy.layers.unit_types import BuiltinUnit, SizeCheck, is_linear_layer
from megastrategy.naming import join_name

__all__ = ["timm_units"]


def _is_timm(m: nn.Module) -> bool:
    return type(m).__module__.split(".")[0] == "timm"


def _plain(m: nn.Module, *names: str) -> bool:
    """The named children are absent, ``None`` or ``nn.Identity``: nothing sits on the local heads."""
    return all(type(getattr(m, n, None)) in (type(None), nn.Identity) for n in names)


def _attention(name: str, m: nn.Module) -> Iterable[BuiltinUnit]:
    heads, width = getattr(m, "num_heads", None), getattr(m, "attn_dim", None)
    if not (is_linear_layer(getattr(m, "qkv", None)) and is_linear_layer(getattr(m, "proj", None))):
        return
    if not (isinstance(heads, int) and isinstance(width, int) and _plain(m, "q_norm", "k_norm", "norm", "gate")):
        return
    dropout = isinstance(getattr(m, "attn_drop", None), nn.Dropout)
    yield BuiltinUnit(
        arch="timm", kind="attention", owner=name,
        members=[(join_name(name, "qkv"), "column", {"packed_chunks": 3}), (join_name(name, "proj"), "row", {})],
        divide_attrs=("num_heads", "attn_dim"),
        checks=[SizeCheck(name, "num_heads", heads, "attention heads")],
        rng_region=(join_name(name, "proj"), "attn_drop.p") if dropout else None,
    )


def _mlp(name: str, m: nn.Module) -> Iterable[BuiltinUnit]:
    if not (is_linear_layer(getattr(m, "fc1", None)) and is_linear_layer(getattr(m, "fc2", None)) and _plain(m, "norm")):
        return
    members = [(join_name(name, "fc1"), "column", {})]
    if isinstance(getattr(m, "drop1", None), nn.Dropout):
        members.append((join_name(name, "drop1"), "dropout", {}))
    members.append((join_name(name, "fc2"), "row", {}))
    yield BuiltinUnit("timm", "mlp", name, members)


def timm_units(name: str, m: nn.Module) -> Iterable[BuiltinUnit]:
    """Units for one timm ViT attention or MLP; nothing for any other module."""
    if not _is_timm(m):
        return
    if type(m).__name__ == "Attention":
        yield from _attention(name, m)
    elif type(m).__name__ == "Mlp":
        yield from _mlp(name, m)
