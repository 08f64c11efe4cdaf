"""Two cuts of a resolved plan, for the setup-time fallback that keeps a failing block whole
(:mod:`megastrategy.layers.block_fallback`): the plan of one block alone, its names rebased onto
the block (to shard a copy of it and check it before the real model is touched), and the plan
with some blocks left out (what is applied to the real model instead)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from megastrategy.layers.plan.resolved import PlanEntry, ResolvedPlan

__all__ = ["restrict_to_block", "without_blocks", "is_within"]


def is_within(name: str | None, block: str) -> bool:
    """``name`` is ``block`` or below it (everything is within the root, ``""``)."""
    return name is not None and (block == "" or name == block or name.startswith(block + "."))


def _rebase(name: str | None, block: str, root: str) -> str | None:
    if name is None or not is_within(name, block):
        return name
    rest = name[len(block):].lstrip(".") if block else name
    return f"{root}.{rest}" if rest else root


def _rebase_extra(extra: Any, block: str, root: str) -> dict[str, Any]:
    """Module names in ``extra`` (``input_copy``, ``tied_to``) rebased like the entry's own name."""
    return {k: _rebase(v, block, root) if isinstance(v, str) and is_within(v, block) else v for k, v in extra.items()}


def restrict_to_block(plan: ResolvedPlan, block: str, root: str = "block") -> ResolvedPlan:
    """The entries, fix-ups and RNG regions of ``plan`` inside ``block``, renamed as if the block
    were the child ``root`` of a holder module: the plan that shards a copy of that block, held
    there, exactly as the whole plan shards the block (entries naming the block itself included:
    an ``nn.MultiheadAttention`` replaced whole, T5's attention taking its heads' position bias)."""
    entries = tuple(
        replace(e, name=_rebase(e.name, block, root), extra=_rebase_extra(e.extra, block, root))
        for e in plan.entries if is_within(e.name, block)
    )
    fixups = tuple(replace(f, module=_rebase(f.module, block, root)) for f in plan.fixups if is_within(f.module, block))
    regions = tuple(
        replace(r, module=_rebase(r.module, block, root), until=_rebase(r.until, block, root))
        for r in plan.rng_regions if is_within(r.module, block)
    )
    return replace(plan, entries=entries, fixups=fixups, rng_regions=regions)


def _kept_whole(e: PlanEntry) -> PlanEntry:
    return replace(e, style="replicate", extra={}, source=f"{e.source} (kept whole)")


def without_blocks(plan: ResolvedPlan, blocks: Iterable[str]) -> ResolvedPlan:
    """``plan`` with every entry inside ``blocks`` turned into ``replicate`` (its source marked
    ``(kept whole)``) and their fix-ups and RNG regions removed: those blocks run unchanged."""
    blocks = list(blocks)

    def inside(name: str | None) -> bool:
        return any(is_within(name, b) for b in blocks)

    return replace(
        plan,
        entries=tuple(_kept_whole(e) if inside(e.name) and e.style != "replicate" else e for e in plan.entries),
        fixups=tuple(f for f in plan.fixups if not inside(f.module)),
        rng_regions=tuple(r for r in plan.rng_regions if not inside(r.module)),
    )
