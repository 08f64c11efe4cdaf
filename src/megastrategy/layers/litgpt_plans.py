"""Built-in plan for Lightning's LitGPT models (``litgpt.model.GPT``), which are not Hugging Face
models, so neither a declared plan nor structural detection reaches them.

LitGPT's ``CausalSelfAttention`` holds one fused ``qkv`` projection laid out ``[q | k | v]``
(``n_head`` query heads, then ``n_query_groups`` key and value heads) and reads its head counts
from ``self.config``, the one ``Config`` object the whole model shares. With as many groups as
heads the three sections are equal, so ``qkv`` is column-parallel in 3 packed chunks and the
attention gets its own config copy with the local head counts (``config.n_head`` as a dotted
fix-up, :mod:`megastrategy.layers.plan.dotted_attrs`). With fewer groups (GQA, MQA) the sections
differ in size, which the shard layout cannot express: refused, naming what works.
"""
from __future__ import annotations

from typing import Iterable, Union

from torch import nn

from megastrategy.layers.unit_types import BuiltinUnit, Refusal, SizeCheck, is_linear_layer
from megastrategy.naming import join_name

__all__ = ["litgpt_units"]

#: LitGPT MLP classes and their (column layers, row layer)
_MLPS = {"LLaMAMLP": (("fc_1", "fc_2"), "proj"), "GemmaMLP": (("fc_1", "fc_2"), "proj"), "GptNeoxMLP": (("fc",), "proj")}


def _is_litgpt(m: nn.Module) -> bool:
    return type(m).__module__.split(".")[0] == "litgpt"


def _attention(name: str, m: nn.Module) -> Iterable[Union[BuiltinUnit, Refusal]]:
    config = getattr(m, "config", None)
    heads, groups = getattr(config, "n_head", None), getattr(config, "n_query_groups", None)
    if not (is_linear_layer(getattr(m, "qkv", None)) and is_linear_layer(getattr(m, "proj", None))):
        return
    if not (isinstance(heads, int) and isinstance(groups, int)):
        return
    if groups != heads or getattr(config, "norm_qk", False):
        why = (f"its fused qkv holds {heads} query heads then {groups} key and {groups} value heads: sections of "
               "unequal sizes, which this strategy cannot shard exactly" if groups != heads
               else "it normalizes q and k (norm_qk=True), which this strategy does not shard")
        yield Refusal(name, "litgpt attention", why, origin="builtin", advice=(
            f"Keep the attention whole with tp_plan={{'*': 'auto', {name.rsplit('.', 2)[0] + '.*.attn'!r}: "
            "'replicate'} (the MLPs and embeddings stay sharded), use n_query_groups=n_head, or use tp=1."))
        return
    yield BuiltinUnit(
        arch="litgpt", kind="attention", owner=name,
        members=[(join_name(name, "qkv"), "column", {"packed_chunks": 3}), (join_name(name, "proj"), "row", {})],
        divide_attrs=("config.n_head", "config.n_query_groups"),
        checks=[SizeCheck(name, "config.n_head", heads, "attention heads")],
    )


def litgpt_units(name: str, m: nn.Module) -> Iterable[Union[BuiltinUnit, Refusal]]:
    """Units (or a refusal) for one LitGPT module; nothing for any other module."""
    if not _is_litgpt(m):
        return
    cls = type(m).__name__
    if cls == "CausalSelfAttention":
        yield from _attention(name, m)
    elif cls in _MLPS:
        columns, row = _MLPS[cls]
        if all(is_linear_layer(getattr(m, c, None)) for c in (*columns, row)):
            members = [(join_name(name, c), "column", {}) for c in columns] + [(join_name(name, row), "row", {})]
            yield BuiltinUnit("litgpt", "mlp", name, members)
    elif cls == "GPT":
        wte = getattr(getattr(m, "transformer", None), "wte", None)
        if type(wte) is nn.Embedding:
            yield BuiltinUnit("litgpt", "embedding", name, [(join_name(name, "transformer.wte"), "vocab", {})])
        if is_linear_layer(getattr(m, "lm_head", None)):
            yield BuiltinUnit("litgpt", "lm_head", name, [(join_name(name, "lm_head"), "vocab", {})])
