"""Built-in plan for Lightning's LitGPT models (``litgpt.model.GPT``), which are not Hugging Face
models, so neither a declared plan nor structural detection reaches them.

LitGPT's ``CausalSelfAttention`` holds one fused ``qkv`` projection laid out ``[q | k | v]``
(``n_head`` query heads, then ``n_query_groups`` key and value heads) and reads its head counts
from ``self.config``, the one ``Config`` object the whole model shares. With as many groups as
heads the three sections are equal, so ``qkv`` is column-parallel in 3 packed chunks; with fewer
groups (GQA, MQA) it is column-parallel in 3 packed sections of unequal sizes
(``packed_sections``: rank r takes its ``n_head/tp`` query heads and its ``n_query_groups/tp``
key and value heads, which are exactly the groups its query heads read). Either way the attention
gets its own config copy with the local head counts (``config.n_head`` and
``config.n_query_groups`` as dotted fix-ups, :mod:`megastrategy.layers.plan.dotted_attrs`).
A tp that is a multiple of the groups (2 groups at tp4) replicates each group on tp/groups ranks
(``multi_query`` reading rank r's query rows and its group's key and value rows;
``config.n_query_groups`` set to 1, :mod:`megastrategy.layers.plan.kv_replication`).
With one group (multi-query) the query heads are split and every rank computes the one key/value
head whole (``multi_query``, :mod:`megastrategy.layers.multi_query`; ``n_query_groups`` stays 1 and
LitGPT's forward repeats it for the local heads). A ``tp`` that neither divides ``n_query_groups``
nor is a multiple of it is refused by the size check, naming the plan that replicates the attention.
"""
from __future__ import annotations

from typing import Iterable, Union

from torch import nn

from megastrategy.layers.unit_types import BuiltinUnit, KeyValueHeads, Refusal, SizeCheck, is_linear_layer
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
    if getattr(config, "norm_qk", False):
        why = "it normalizes q and k (norm_qk=True), which this strategy does not shard"
        advice = f"Keep the attention whole with {_replicate_plan(name)}, or use tp=1."
        yield Refusal(name, "litgpt attention", why, origin="builtin", advice=advice)
        return
    size, rest = divmod(m.qkv.out_features, heads + 2 * groups)
    if rest:  # not the [q|k|v] layout this plan knows
        return
    if groups == 1 and heads > 1:
        yield _multi_query(name, m, heads, size)
        return
    sizes = (heads * size, groups * size, groups * size)
    sections = {"packed_chunks": 3} if groups == heads else {"packed_sections": sizes}
    yield BuiltinUnit(
        arch="litgpt", kind="attention", owner=name,
        members=[(join_name(name, "qkv"), "column", sections), (join_name(name, "proj"), "row", {})],
        divide_attrs=("config.n_head", "config.n_query_groups"),
        checks=[SizeCheck(name, "config.n_head", heads, "attention heads"),
                SizeCheck(name, "config.n_query_groups", groups, "key/value head groups", advice=(
                    "Each rank's query heads must find their key/value heads on that rank; otherwise keep the "
                    f"attention whole with {_replicate_plan(name)} (the MLPs and embeddings stay sharded)."))],
        kv_heads=None if groups == heads else KeyValueHeads(
            groups, heads, size, (join_name(name, "qkv"),), "config.n_query_groups", ("config.n_query_groups",),
            packed=True),
    )


def _multi_query(name: str, m: nn.Module, heads: int, head_size: int) -> BuiltinUnit:
    """One key/value head: the query heads split, the key/value head whole on every rank."""
    layout = {"q_heads": heads, "kv_heads": 1, "head_dim": head_size}
    return BuiltinUnit(
        arch="litgpt", kind="attention", owner=name,
        members=[(join_name(name, "qkv"), "multi_query", layout), (join_name(name, "proj"), "row", {})],
        divide_attrs=("config.n_head",), checks=[SizeCheck(name, "config.n_head", heads, "attention heads")],
    )


def _replicate_plan(name: str) -> str:
    """The ``tp_plan`` that keeps every attention like ``name`` whole."""
    return f"tp_plan={{'*': 'auto', {name.rsplit('.', 2)[0] + '.*.attn'!r}: 'replicate'}}"


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
