"""Hugging Face's own tensor-parallel plan, translated into this project's units.

``transformers`` 5.x declares, for ~130 architectures, which layers are sharded and how:
the config's ``base_model_tp_plan`` merged with the model class's ``_tp_plan`` (the
``lm_head``) into ``model.tp_plan``, keys relative to the outermost ``PreTrainedModel``
with ``*`` standing for a layer index. This module reads that declaration (pure: nothing is
modified) and turns it into :class:`~megastrategy.layers.builtin_plans.BuiltinUnit` s, so the
rest of the plan passes (units, ties, sizes, apply) treat it like a built-in plan.

Translation (exact, never approximated; see :data:`TRANSLATION`):

=================================  =====================================================
``colwise``                        ``column`` (output split; local heads)
``rowwise``                        ``row`` (input split, partial outputs all-reduced)
``colwise_gather_output`` /        ``column`` with ``gather_output``: full output on
``colwise_rep``                    every rank (backward: the rank's slice of the grad)
``rowwise_split_input`` /          ``row`` with ``split_input``: the replicated input is
``rowwise_rep``                    sliced locally, partial outputs all-reduced
``packed_colwise`` (2-D weight)    ``column`` with ``packed_chunks=2`` ([gate|up])
``embedding_rowwise``              ``vocab`` embedding (exact ``nn.Embedding`` only)
``colwise_gather_output`` on the   ``vocab`` head: vocab-parallel logits and loss
model's output embeddings
``replicated_with_grad_allreduce`` ``grad_sum``: module kept whole, its parameters'
                                   gradients summed over TP in backward (per-head norms)
``replicate``                      left alone
=================================  =====================================================

A declared attention with fewer key/value heads than ``tp`` (grouped-query: Qwen2.5-1.5B's 2 at tp4;
multi-query: Gemma-2B's one) cannot split its ``colwise`` ``k_proj``/``v_proj``: the unit records them
(:class:`~megastrategy.layers.unit_types.KeyValueHeads`) and plan resolution at such a tp replicates
each key/value head on the ranks whose query heads read it, as Megatron does
(:mod:`megastrategy.layers.plan.kv_replication`); the query heads split as declared.

Every other style (MoE experts, MLA, ``local_params``, ``embedding_colwise``, ...) is
*refused*: the module is listed in :attr:`DeclaredPlan.refused` and the plan resolution
raises at ``tp > 1`` unless the user's ``tp_plan`` decides for that module.
Layers of one parent module form one unit (sharded together or not at all).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from megastrategy.fused_experts import holds_expert_weights, is_fused_experts
from megastrategy.layers.lora_plan import LORA_ADVICE, is_lora_layer, lora_members, lora_unsupported
from megastrategy.layers.unit_types import (
    GROUP_ATTRS, HEAD_ATTRS, BuiltinUnit, KeyValueHeads, Refusal, SizeCheck, is_hf_pretrained, is_linear_layer,
)
from megastrategy.naming import join_name, parent_name

__all__ = ["TRANSLATION", "TRANSLATED_STYLES", "DeclaredPlan", "declared_plan"]

#: Hugging Face style -> (this project's style, extra); ``None``: left alone
TRANSLATION: dict[str, tuple[str, dict[str, Any]] | None] = {
    "colwise": ("column", {}),
    "rowwise": ("row", {}),
    "colwise_gather_output": ("column", {"gather_output": True}),
    "colwise_rep": ("column", {"gather_output": True}),
    "rowwise_split_input": ("row", {"split_input": True}),
    "rowwise_rep": ("row", {"split_input": True}),
    "packed_colwise": ("column", {"packed_chunks": 2}),
    "embedding_rowwise": ("vocab", {}),
    "replicated_with_grad_allreduce": ("grad_sum", {}),
    "replicate": None,
}
TRANSLATED_STYLES = tuple(TRANSLATION)


@dataclass
class DeclaredPlan:
    units: list[BuiltinUnit] = field(default_factory=list)
    #: outermost Hugging Face models whose declared plan is used -> model_type
    roots: dict[str, str] = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)


def _outermost_hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if is_hf_pretrained(m) and not any(r == "" or name.startswith(r + ".") for r, _ in found):
            found.append((name, m))
    return found


def _key_regex(key: str) -> re.Pattern:
    """HF plan keys: ``*`` stands for one layer index."""
    return re.compile("^" + r"\d+".join(re.escape(p) for p in key.split("*")) + "$")


def declared_plan(module: nn.Module) -> DeclaredPlan:
    """The declared plans of the Hugging Face models inside ``module`` (names relative to it)."""
    out = DeclaredPlan()
    for root_name, root in _outermost_hf_models(module):
        plan = getattr(root, "_tp_plan", None) or {}
        if not plan:
            continue
        model_type = str(getattr(getattr(root, "config", None), "model_type", type(root).__name__)).lower()
        out.roots[root_name] = model_type
        _Translator(root_name, root, model_type, out).run(plan)
    return out


class _Translator:
    """One Hugging Face model's declared plan -> units and refusals."""

    def __init__(self, root_name: str, root: nn.Module, arch: str, out: DeclaredPlan) -> None:
        self.root_name, self.root, self.arch, self.out = root_name, root, arch, out
        self.modules = dict(root.named_modules())
        self.params = [n for n, _ in root.named_parameters()]
        get_out = getattr(root, "get_output_embeddings", None)
        self.output_embeddings = get_out() if callable(get_out) else None
        #: weights of embeddings with their own forward (kept whole), and of heads tied to them
        self.whole_weights = {id(m.weight) for m in self.modules.values()
                              if isinstance(m, nn.Embedding) and not _is_plain_embedding(m)}
        self.members: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}

    def run(self, plan: dict[str, str]) -> None:
        # experts stay whole on every TP rank (exact): fused ones, GPT-OSS's, and Llama 4's, whose declared
        # 'packed_rowwise' on a bare 3-D parameter has no exact equivalent here; expert parallelism splits them
        fused = {n for n, m in self.modules.items() if n and (is_fused_experts(m) or holds_expert_weights(m))}
        for key, style in plan.items():
            pattern = _key_regex(key)
            for local in [n for n in self.modules if n and pattern.match(n) and n not in fused]:
                self._module(local, style)
            for local in [p for p in self.params if pattern.match(p) and parent_name(p) not in fused]:
                self._refuse(local, style, "the declaration names a parameter (a fused MoE expert weight or a "
                             "bare parameter), which only Hugging Face's DTensor path shards")
        for parent, members in self.members.items():
            self.out.units.append(self._unit(parent, members))

    def _refuse(self, local: str, style: str, reason: str, advice: str = "") -> None:
        self.out.refused.append(Refusal(join_name(self.root_name, local), style, reason, "declared", advice))

    def _module(self, local: str, style: str) -> None:
        m = self.modules[local]
        if style not in TRANSLATION:
            self._refuse(local, style, f"style {style!r} has no exact equivalent here")
            return
        translated = TRANSLATION[style]
        if translated is None:
            return
        ours, extra = translated
        if ours == "vocab" and not _is_plain_embedding(m):
            return  # an embedding with its own forward (e.g. scaled): kept whole, which is exact
        if ours == "column" and extra.get("gather_output") and m is self.output_embeddings:
            if id(getattr(m, "weight", None)) in self.whole_weights:
                return  # tied to an embedding kept whole: the head stays whole too
            ours, extra = "vocab", {}
        name = join_name(self.root_name, local)
        if ours in ("column", "row") and is_lora_layer(m):
            unsupported = lora_unsupported(m)
            if unsupported:
                self._refuse(local, style, unsupported, LORA_ADVICE)
            else:
                self.members.setdefault(parent_name(name), []).extend(lora_members(name, m, ours, extra))
            return
        if ours in ("column", "row") and not is_linear_layer(m):
            self._refuse(local, style, f"it is a {type(m).__name__}, not an nn.Linear")
            return
        self.members.setdefault(parent_name(name), []).append((name, ours, dict(extra)))

    def _unit(self, owner: str, members: list[tuple[str, str, dict[str, Any]]]) -> BuiltinUnit:
        splits_heads = any(s == "column" and not e.get("gather_output") for _, s, e in members)
        kind = owner.rsplit(".", 1)[-1] or "model"
        if all(s == "vocab" for _, s, _ in members):
            kind = "embedding" if all(isinstance(self._mod(n), nn.Embedding) for n, _, _ in members) else "lm_head"
        owner_mod = self._mod(owner)
        dropout = getattr(owner_mod, "attention_dropout", None)
        has_dropout_p = isinstance(dropout, (int, float)) and not isinstance(dropout, bool)
        attention = splits_heads and _is_attention(owner_mod, kind)
        checks = self._head_checks(owner) if attention else []
        divide = HEAD_ATTRS if splits_heads else ()
        return BuiltinUnit(
            arch=self.arch,
            kind=kind,
            owner=owner,
            members=members,
            divide_attrs=divide,
            checks=checks,
            rng_region=(None, "attention_dropout") if splits_heads and has_dropout_p else None,
            origin="declared",
            kv_heads=self._grouped_kv_heads(owner_mod, members) if attention else None,
        )

    def _grouped_kv_heads(self, owner_mod: nn.Module, members: list[tuple[str, str, dict[str, Any]]]) -> KeyValueHeads | None:
        """Fewer key/value heads than query heads (grouped-query, multi-query): the column members as wide as
        the key/value heads, replicated when tp exceeds them; ``None`` when the config does not count both
        heads, or when a member is a LoRA part (its adapter would have to follow)."""
        config = self._text_config()
        heads, kv_heads = _int(getattr(config, "num_attention_heads", None)), _int(getattr(config, "num_key_value_heads", None))
        head_dim = _int(getattr(owner_mod, "head_dim", None))
        if heads is None or kv_heads is None or head_dim is None or not 0 < kv_heads < heads or heads % kv_heads:
            return None
        if any(".lora_" in n or n.endswith(".base_layer") for n, _, _ in members):
            return None
        width = kv_heads * head_dim
        kv = tuple(n for n, st, e in members if st == "column" and not e and getattr(self._mod(n), "out_features", None) == width)
        if not kv:
            return None
        counts = tuple(a for a in HEAD_ATTRS if _int(getattr(owner_mod, a, None)) == kv_heads)
        groups = tuple(a for a in GROUP_ATTRS if _int(getattr(owner_mod, a, None)) == heads // kv_heads)
        return KeyValueHeads(kv_heads, heads, head_dim, kv, "config.num_key_value_heads", counts, groups)

    def _text_config(self) -> Any:
        config = getattr(self.root, "config", None)
        get_text = getattr(config, "get_text_config", None)
        return get_text() if callable(get_text) else config

    def _mod(self, name: str) -> nn.Module:
        local = name[len(self.root_name) + 1:] if self.root_name else name
        return self.modules[local] if local else self.root

    def _head_checks(self, owner: str) -> list[SizeCheck]:
        config = self._text_config()
        checks = []
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                checks.append(SizeCheck(owner, f"config.{attr}", value, "attention heads"))
        return checks


def _is_attention(m: nn.Module, kind: str) -> bool:
    return hasattr(m, "head_dim") or "att" in kind.lower() or "att" in type(m).__name__.lower()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_plain_embedding(m: nn.Module) -> bool:
    return isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward
