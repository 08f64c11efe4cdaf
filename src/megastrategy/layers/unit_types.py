"""The types every plan source produces: a unit (layers of one block sharded together), the
sizes ``tp`` must divide, and the detection result; plus the layer tests they share.

Built-in plans (:mod:`megastrategy.layers.builtin_plans`, :mod:`megastrategy.layers.encoder_plans`)
and Hugging Face's declared plans (:mod:`megastrategy.layers.hf_declared`) all describe what they
recognize with these types, so the plan passes treat every source alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = [
    "HEAD_ATTRS",
    "GROUP_ATTRS",
    "SizeCheck",
    "KeyValueHeads",
    "BuiltinUnit",
    "BuiltinDetection",
    "Refusal",
    "is_conv1d",
    "is_hf_pretrained",
    "is_linear_layer",
    "child",
    "int_attr",
]

#: integer attributes that count heads (or head-derived sizes): divided by tp on the module
#: owning column-sharded projections, since the unchanged forward runs on the local heads
HEAD_ATTRS = (
    "num_heads",
    "n_head",
    "n_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "num_kv_heads",
    "all_head_size",
)
#: query heads per key/value head (Llama-style ``repeat_kv``): unchanged while tp splits the key/value
#: heads, set to the local query heads where they are replicated
GROUP_ATTRS = ("num_key_value_groups",)


@dataclass(frozen=True)
class SizeCheck:
    """``value`` (read from ``owner``'s ``attr``) must be divisible by ``tp``; ``advice``, when
    given, is the fix the error names besides another ``tp`` (e.g. the plan that replicates)."""

    owner: str
    attr: str
    value: int
    what: str
    advice: str = ""


@dataclass(frozen=True)
class KeyValueHeads:
    """A grouped-query attention's key/value heads, for a tp that exceeds them
    (:mod:`megastrategy.layers.plan.kv_replication`): ``count`` key/value heads of ``head_dim``
    shared by ``query_heads`` query heads. ``members``: the unit's projections holding them;
    ``check``: the attribute of the unit's size check on their count; ``count_attrs``: the owner's
    attributes that count them; ``group_attrs``: the owner's query heads per key/value head;
    ``packed``: the members are ``[q | k | v]`` projections (LitGPT's ``qkv``), not ``k_proj``/``v_proj``."""

    count: int
    query_heads: int
    head_dim: int
    members: tuple[str, ...]
    check: str
    count_attrs: tuple[str, ...] = ()
    group_attrs: tuple[str, ...] = ()
    packed: bool = False
    #: packed per key/value head as ``[its query heads | k | v]`` (Falcon's grouped layout)
    interleaved: bool = False

    def replicated_style(self) -> tuple[str, dict[str, Any]]:
        """The members' style and extra where tp replicates these heads."""
        if not self.packed:
            return "kv_whole", {"kv_heads": self.count, "head_dim": self.head_dim}
        extra: dict[str, Any] = {"q_heads": self.query_heads, "kv_heads": self.count, "head_dim": self.head_dim}
        return "multi_query", {**extra, "interleaved": True} if self.interleaved else extra


@dataclass
class BuiltinUnit:
    """Layers of one recognized block that are sharded together, and what goes with them.

    ``members``: ``(module name, style, extra)``; ``style`` is one of ``column``, ``row``,
    ``vocab``, ``attention`` (``nn.MultiheadAttention`` replaced as a whole) or ``dropout``
    (an ``nn.Dropout`` acting on sharded activations). ``divide_attrs``: integer attributes
    of ``owner`` that count local heads/sizes and are divided by ``tp`` (only those that
    exist are used). ``rng_region``: ``(until, dropout_p_path)`` -- ``owner``'s forward runs
    on the per-TP-rank RNG stream (from its start until the forward pre-hook of module
    ``until``, or to its end when ``until`` is ``None``) while training with a dropout
    probability (read at ``dropout_p_path`` on ``owner``) above zero.
    """

    arch: str
    kind: str
    owner: str
    members: list[tuple[str, str, dict[str, Any]]]
    divide_attrs: tuple[str, ...] = ()
    checks: list[SizeCheck] = field(default_factory=list)
    rng_region: tuple[str | None, str] | None = None
    #: ``"builtin"`` (this project's class rules), ``"declared"`` (Hugging Face's tp_plan) or
    #: ``"structural"`` (traced data flow, :mod:`megastrategy.layers.structural_plans`)
    origin: str = "builtin"
    #: fewer key/value heads than query heads: replicated over the ranks when tp exceeds them
    kv_heads: KeyValueHeads | None = None
    #: ``(attribute, per-rank value)`` set on ``owner`` whatever tp divides (replicated key/value heads)
    set_attrs: tuple[tuple[str, int], ...] = ()

    @property
    def source(self) -> str:
        """Where a plan entry of this unit comes from, as shown in the plan table."""
        prefix = {"declared": "declared", "structural": "structural"}.get(self.origin, "auto")
        return f"{prefix}:{self.arch}"


@dataclass(frozen=True)
class Refusal:
    """A declared style this project cannot reproduce exactly on ``module``; plan resolution
    raises at ``tp > 1`` unless the user's ``tp_plan`` decides for that module."""

    module: str
    style: str
    reason: str
    #: ``"declared"`` (a Hugging Face style with no exact translation), ``"structural"`` or ``"builtin"`` (a class rule: LitGPT)
    origin: str = "declared"
    #: what to do instead, when keeping the module whole (the usual advice) would not work
    advice: str = ""


@dataclass
class BuiltinDetection:
    units: list[BuiltinUnit]
    #: names of Hugging Face ``PreTrainedModel`` instances of a known architecture
    recognized_roots: dict[str, str]
    refused: list[Refusal] = field(default_factory=list)

    @property
    def architectures(self) -> list[str]:
        seen: list[str] = []
        for unit in self.units:
            if unit.arch not in seen:
                seen.append(unit.arch)
        return seen

    def member_index(self) -> dict[str, tuple[BuiltinUnit, str, dict[str, Any]]]:
        index: dict[str, tuple[BuiltinUnit, str, dict[str, Any]]] = {}
        for unit in self.units:
            for name, style, extra in unit.members:
                index.setdefault(name, (unit, style, extra))
        return index


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face ``Conv1D`` (GPT-2): a linear layer whose weight is stored ``[in, out]``."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and module.weight.dim() == 2
    )


def is_hf_pretrained(module: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def is_linear_layer(m: Any) -> bool:
    return isinstance(m, nn.Linear) or (isinstance(m, nn.Module) and is_conv1d(m))


def child(m: nn.Module, path: str) -> Any:
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def int_attr(m: nn.Module, path: str) -> int | None:
    value = child(m, path)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None
