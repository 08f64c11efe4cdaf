"""What :func:`~megastrategy.layers.plan.resolve_tp_plan` decides: the public, frozen result
that users inspect and print and that :func:`~megastrategy.layers.plan.apply_tp_plan` follows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megastrategy.naming import join_name

__all__ = ["PlanEntry", "FixUp", "RNGRegion", "ResolvedPlan"]


@dataclass(frozen=True)
class PlanEntry:
    """One module and what happens to it.

    ``style``: ``column``, ``row``, ``vocab``, ``replicate``, or (auto-detection only)
    ``attention`` (an ``nn.MultiheadAttention`` replaced by
    ``TensorParallelMultiheadAttention``), ``dropout`` (an ``nn.Dropout`` on sharded
    activations, replaced by ``TensorParallelRegionDropout``), ``multi_query`` (a packed
    ``[q | k | v]`` with one key/value head: the query heads split, the key/value head whole) and
    ``kv_whole`` (a key/value projection of its own with fewer heads than ``tp``: each rank computes the head
    its query heads read, :mod:`megastrategy.layers.plan.kv_replication`), both :mod:`megastrategy.layers.multi_query`.

    ``extra`` (a dict; treat it as read-only), keys present when relevant:
    ``packed_chunks`` (int > 1), ``packed_sections`` (the output sizes of unequal packed
    projections, e.g. a grouped-query ``[q|k|v]``), ``q_heads``/``kv_heads``/``head_dim`` (``multi_query``; ``kv_heads``/``head_dim``/``kv_replicas``, the ranks
    holding each head, for ``kv_whole``), ``weight_layout`` (``"in_out"`` for HF ``Conv1D``),
    ``input_copy`` (name of the parent whose column layers share one ``SharedInputCopy``),
    ``vocab_layer`` (``"embedding"`` or ``"head"``), ``tied_to`` (a vocab head's embedding),
    ``bias_aliases`` (attribute names on the head's parent that alias the head's bias and are
    re-pointed to the sharded bias), ``unit`` (``"<arch>.<kind>"`` of a built-in block).

    ``source``: ``"auto:<arch>"``, ``"tp_plan[<glob>]"`` or ``"default"``.
    """

    name: str
    style: str
    module_type: str
    extra: Mapping[str, Any]
    source: str

    def as_tuple(self) -> tuple[str, str, dict[str, Any]]:
        return (self.name, self.style, dict(self.extra))


@dataclass(frozen=True)
class FixUp:
    """Set attribute ``attr`` of module ``module`` from ``old`` to ``new`` when applying."""

    module: str
    attr: str
    old: Any
    new: Any
    reason: str


@dataclass(frozen=True)
class RNGRegion:
    """While training with dropout ``p > 0`` (read at ``dropout_p`` on ``module``), the forward
    of ``module`` runs on the per-TP-rank RNG stream, from its start until the forward
    pre-hook of ``until`` (to its end when ``None``)."""

    module: str
    until: str | None
    dropout_p: str


@dataclass(frozen=True)
class ResolvedPlan:
    """The outcome of :func:`resolve_tp_plan`; inspect it, print it, hand it to
    :func:`apply_tp_plan`."""

    tp_size: int
    entries: tuple[PlanEntry, ...]
    fixups: tuple[FixUp, ...] = ()
    rng_regions: tuple[RNGRegion, ...] = ()
    architectures: tuple[str, ...] = ()
    auto: bool = False
    tp_plan: Mapping[str, str] | None = None

    # -- inspection ------------------------------------------------------------------------
    def items(self) -> list[tuple[str, str, dict[str, Any]]]:
        """``(name, style, extra)`` for every entry (sharded and replicated layers)."""
        return [e.as_tuple() for e in self.entries]

    @property
    def sharded(self) -> tuple[PlanEntry, ...]:
        """Entries that change the module (everything but ``replicate``)."""
        return tuple(e for e in self.entries if e.style != "replicate")

    def styles(self) -> dict[str, str]:
        """``{name: style}`` for every entry."""
        return {e.name: e.style for e in self.entries}

    def __getitem__(self, name: str) -> PlanEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(e.name == name for e in self.entries)

    # -- printing --------------------------------------------------------------------------
    def table(self) -> str:
        """A plain-text table for logs."""
        header = f"Tensor-parallel plan: tp={self.tp_size}"
        if self.architectures:
            header += f", recognized: {', '.join(self.architectures)}"
        header += f", {len(self.sharded)} layer(s) sharded"
        rows = [("module", "style", "type", "extra", "source")]
        for e in self.entries:
            extra = ", ".join(f"{k}={v}" for k, v in e.extra.items() if k != "unit")
            rows.append((e.name, e.style, e.module_type, extra, e.source))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [header]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if self.fixups:
            lines.append("attribute fix-ups (full -> local):")
            for f in self.fixups:
                lines.append(f"  {join_name(f.module, f.attr)}: {f.old!r} -> {f.new!r}  ({f.reason})")
        if self.rng_regions:
            lines.append("per-TP-rank RNG stream (attention dropout on local heads):")
            for r in self.rng_regions:
                until = f"until {r.until}" if r.until else "whole forward"
                lines.append(f"  {r.module or '<root>'} ({until}; p from {r.dropout_p})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
