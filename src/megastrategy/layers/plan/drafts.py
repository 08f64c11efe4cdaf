"""The typed working entry the resolution passes refine, and the passes that create entries
from the effective styles and fill in how each layer is laid out."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.builtin_plans import BuiltinUnit, is_conv1d
from megastrategy.layers.lora_plan import LORA_ADVICE, is_lora_layer, lora_members, lora_unsupported
from megastrategy.layers.plan.context import PlanContext
from megastrategy.layers.plan.layer_kinds import is_linear, is_weight_layer, style_fits, style_hint, type_name
from megastrategy.layers.plan.match import Effective
from megastrategy.layers.plan.rules import AUTO
from megastrategy.naming import parent_name

__all__ = ["DraftEntry", "Drafts", "draft_entries", "add_layout"]


@dataclass
class DraftEntry:
    """One module's entry while the passes refine it; frozen into a
    :class:`~megastrategy.layers.plan.PlanEntry` at the end. Each optional field is set by one
    pass and becomes a key of ``PlanEntry.extra`` when set (see its docstring)."""

    style: str
    source: str
    #: the recognized block this layer belongs to, if sharded the built-in way
    unit: BuiltinUnit | None = None
    packed_chunks: int | None = None
    #: unequal packed projections (grouped-query ``[q|k|v]``): their output sizes
    packed_sections: tuple[int, ...] | None = None
    #: a column layer whose output is all-gathered (Hugging Face ``colwise_gather_output``)
    gather_output: bool | None = None
    #: a row layer that slices its replicated input itself (``rowwise_split_input``)
    split_input: bool | None = None
    weight_layout: str | None = None
    vocab_layer: str | None = None
    input_copy: str | None = None
    tied_to: str | None = None
    bias_aliases: tuple[str, ...] | None = None
    #: ``head_table``/``head_bias_input``: the full head count (and the bias argument's name)
    heads: int | None = None
    bias_kwarg: str | None = None
    #: ``head_vector``: the attention's own per-head parameter vectors (DeBERTa v1's q_bias, v_bias)
    params: tuple[str, ...] | None = None
    #: ``multi_query`` (``kv_whole``: ``kv_heads``, ``head_dim``): the packed projection's query and key/value heads and their size
    q_heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    #: ``multi_query``: packed per key/value head (Falcon's grouped ``[groups, q per group + 2, head_dim]``)
    interleaved: bool | None = None
    #: ``kv_whole``: the ranks holding each key/value head (tp / its key/value heads)
    kv_replicas: int | None = None

    @classmethod
    def builtin(cls, style: str, source: str, unit: BuiltinUnit, extra: dict[str, Any]) -> "DraftEntry":
        """An entry of a recognized block (``packed_chunks``, ``gather_output``, ``split_input``)."""
        return cls(
            style,
            source,
            unit,
            packed_chunks=extra.get("packed_chunks"),
            packed_sections=extra.get("packed_sections"),
            gather_output=extra.get("gather_output"),
            split_input=extra.get("split_input"),
            heads=extra.get("heads"),
            bias_kwarg=extra.get("bias_kwarg"),
            params=extra.get("params"),
            q_heads=extra.get("q_heads"),
            kv_heads=extra.get("kv_heads"),
            head_dim=extra.get("head_dim"),
            interleaved=extra.get("interleaved"),
        )

    @property
    def chunks(self) -> int:
        """Projections packed side by side in the output (1 for a plain layer)."""
        if self.packed_sections:
            return len(self.packed_sections)
        return 1 if self.packed_chunks is None else int(self.packed_chunks)

    def extra(self) -> dict[str, Any]:
        """``PlanEntry.extra``: the fields that are set, in the order the passes set them."""
        unit = f"{self.unit.arch}.{self.unit.kind}" if self.unit is not None else None
        pairs = (
            ("packed_chunks", self.packed_chunks),
            ("packed_sections", self.packed_sections),
            ("gather_output", self.gather_output),
            ("split_input", self.split_input),
            ("weight_layout", self.weight_layout),
            ("vocab_layer", self.vocab_layer),
            ("unit", unit),
            ("input_copy", self.input_copy),
            ("tied_to", self.tied_to),
            ("bias_aliases", self.bias_aliases),
            ("heads", self.heads),
            ("bias_kwarg", self.bias_kwarg),
            ("params", self.params),
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("interleaved", self.interleaved),
            ("kv_replicas", self.kv_replicas),
        )
        return {k: v for k, v in pairs if v is not None}


#: module name -> its entry, in the order the passes add them
Drafts = dict[str, DraftEntry]


def draft_entries(ctx: PlanContext, effective: dict[str, Effective]) -> Drafts:
    """An entry for every module the rules give a style (replicated containers and layers
    auto-detection does not recognize get none); explicit styles must fit their module."""
    member_index = ctx.detection.member_index()
    drafts: Drafts = {}
    for n in ctx.names:
        if n not in effective:
            continue
        style, rule, _ = effective[n]
        m = ctx.modules[n]
        hit = member_index.get(n)
        if style == "replicate":
            if is_weight_layer(m):
                drafts[n] = DraftEntry("replicate", rule.source)
        elif style == AUTO:
            if hit is not None:
                unit, bstyle, bextra = hit
                drafts[n] = DraftEntry.builtin(bstyle, unit.source, unit, bextra)
        elif style in ("column", "row") and is_lora_layer(m):
            drafts.update(_lora_entries(n, m, style, rule.glob, rule.source))
        else:
            drafts[n] = _explicit_entry(n, m, style, rule.glob, rule.source, hit)
    return drafts


def _lora_entries(n: str, m: nn.Module, style: str, glob: str, source: str) -> Drafts:
    """A user's column/row entry naming a layer PEFT wrapped with LoRA: the base layer and the adapter
    half that follows it take the style (:mod:`megastrategy.layers.lora_plan`), as a declared plan's do."""
    unsupported = lora_unsupported(m)
    if unsupported:
        raise MegatronConfigError(f"tp_plan[{glob!r}]={style!r} matches {n!r}: {unsupported}. {LORA_ADVICE}")
    return {name: DraftEntry(member_style, source) for name, member_style, _ in lora_members(n, m, style, {})}


#: detected styles that are a way of splitting a layer's query heads: a user's ``column`` on such a layer
#: keeps them (the key/value heads of a multi-query projection stay whole, :mod:`megastrategy.layers.multi_query`)
_COLUMN_WAYS = ("multi_query", "kv_whole")


def _explicit_entry(n: str, m: nn.Module, style: str, glob: str, source: str, hit: Any) -> DraftEntry:
    """A user-given sharding style; where it agrees with a recognized block, keep the block's
    knowledge of how (packed QKV, multi-query, fix-ups, RNG regions)."""
    if not style_fits(style, m):
        raise MegatronConfigError(
            f"tp_plan[{glob!r}]={style!r} matches {n!r} (type {type_name(m)}): style {style!r} "
            f"does not apply to it; {style_hint(m)}."
        )
    if style == "column" and isinstance(m, nn.Dropout):
        style = "dropout"
    if hit is not None and (hit[1] == style or style == "column" and hit[1] in _COLUMN_WAYS):
        unit, bstyle, bextra = hit
        return DraftEntry.builtin(bstyle, source, unit, bextra)
    return DraftEntry(style, source)


def add_layout(ctx: PlanContext, drafts: Drafts) -> None:
    """Weight layout (HF ``Conv1D``), vocab kind, and one shared input copy per parent whose
    several column layers read the same input."""
    for n, d in drafts.items():
        m = ctx.modules[n]
        if d.style in ("column", "row", "vocab") and is_conv1d(m):
            d.weight_layout = "in_out"
        if d.style == "vocab":
            d.vocab_layer = "embedding" if isinstance(m, nn.Embedding) else "head"
    by_parent: dict[str, list[str]] = defaultdict(list)
    for n, d in drafts.items():
        if d.style == "column" and is_linear(ctx.modules[n]):
            by_parent[parent_name(n)].append(n)
    for parent, members in by_parent.items():
        if len(members) > 1:
            for n in members:
                drafts[n].input_copy = parent
