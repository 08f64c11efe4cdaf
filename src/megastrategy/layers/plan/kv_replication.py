"""The key/value replication pass: an attention with fewer key/value heads than ``tp`` (Qwen2.5-1.5B's
2 at tp4, Gemma-2B's one at tp2) replicates each key/value head on the ranks whose query heads read it,
as Megatron does when tp exceeds the query groups.

With ``n_kv`` key/value heads, ``n_q`` query heads and ``tp`` a multiple of ``n_kv``, rank ``r`` holds
the query heads ``[r·n_q/tp, (r+1)·n_q/tp)`` (its column split) and the one key/value head
``r // (tp/n_kv)`` they belong to: its key/value projections become ``kv_whole``
(:class:`~megastrategy.layers.multi_query.MultiQueryPackedLinear` reading that head's rows of the whole
weight, the weight gradient summed over TP: zero on the rows a rank does not read, so the sum is the
full model's gradient on every rank); a packed projection (LitGPT's ``[q | k | v]``, Falcon's per-group
``[q per group | k | v]`` blocks: ``interleaved``) becomes ``multi_query`` reading the rank's query rows and
its head's key and value rows. The attention then counts one key/value head and ``n_q/tp``
query heads per key/value head (:attr:`~megastrategy.layers.unit_types.BuiltinUnit.set_attrs`).
Where ``tp`` divides ``n_kv`` the key/value heads are split as usual; a ``tp`` that neither divides nor
is a multiple of ``n_kv`` is refused by the size check on the key/value heads, whose advice names the
tp values that replicate.
"""
from __future__ import annotations

from dataclasses import replace

from megastrategy.divisors import divisors
from megastrategy.layers.plan.drafts import DraftEntry, Drafts
from megastrategy.layers.unit_types import BuiltinUnit, KeyValueHeads

__all__ = ["replicate_kv_heads", "replicates_kv_heads"]


def replicates_kv_heads(kv: KeyValueHeads, tp: int) -> bool:
    """Whether ``tp`` replicates these key/value heads (rather than splitting or refusing)."""
    return tp > kv.count and tp % kv.count == 0


def replicate_kv_heads(tp: int, drafts: Drafts, units: list[BuiltinUnit]) -> list[BuiltinUnit]:
    """``units`` with every attention whose key/value heads ``tp`` replicates rewritten (its drafts
    re-pointed to the new unit), and the others' key/value size check advising the tp that replicate."""
    out = []
    for unit in units:
        kv = unit.kv_heads
        replicated = kv is not None and replicates_kv_heads(kv, tp)
        new = unit if kv is None else _replicated(unit, kv, tp) if replicated else _advised(unit, kv)
        for n, d in drafts.items():
            if d.unit is unit:
                d.unit = new
                if replicated and n in kv.members:
                    _replicate_entry(d, kv, tp)
        out.append(new)
    return out


def _replicate_entry(d: DraftEntry, kv: KeyValueHeads, tp: int) -> None:
    style, extra = kv.replicated_style()
    d.style, d.packed_sections, d.packed_chunks, d.kv_replicas = style, None, None, tp // kv.count
    d.q_heads, d.kv_heads, d.head_dim = extra.get("q_heads"), extra["kv_heads"], extra["head_dim"]
    d.interleaved = extra.get("interleaved")


def _replicated(unit: BuiltinUnit, kv: KeyValueHeads, tp: int) -> BuiltinUnit:
    style, extra = kv.replicated_style()
    return replace(
        unit,
        members=[(n, style, dict(extra)) if n in kv.members else (n, s, e) for n, s, e in unit.members],
        checks=[c for c in unit.checks if c.attr not in (kv.check, *kv.count_attrs)],
        divide_attrs=tuple(a for a in unit.divide_attrs if a not in kv.count_attrs + kv.group_attrs),
        set_attrs=tuple((a, 1) for a in kv.count_attrs) + tuple((a, kv.query_heads // tp) for a in kv.group_attrs),
    )


def _advised(unit: BuiltinUnit, kv: KeyValueHeads) -> BuiltinUnit:
    replicating = [t for t in divisors(kv.query_heads) if t > kv.count and t % kv.count == 0]
    if not replicating:
        return unit
    advice = (f"Or use tp in {{{', '.join(map(str, replicating))}}}: a multiple of the {kv.count} key/value head(s) "
              f"dividing the {kv.query_heads} query heads, which replicates each key/value head on tp/{kv.count} ranks.")
    checks = [replace(c, advice=f"{c.advice} {advice}".strip()) if c.attr == kv.check else c for c in unit.checks]
    return replace(unit, checks=checks)

