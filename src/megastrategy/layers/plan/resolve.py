""":func:`resolve_tp_plan` as a list of named passes over typed working entries."""
from __future__ import annotations

from torch import nn

from megastrategy.layers.builtin_plans import BuiltinUnit
from megastrategy.layers.plan.context import PlanContext
from megastrategy.layers.plan.coverage import add_known_replicated, check_coverage, drop_inside_attention
from megastrategy.layers.plan.drafts import Drafts, add_layout, draft_entries
from megastrategy.layers.plan.kv_replication import replicate_kv_heads
from megastrategy.layers.plan.layer_kinds import type_name
from megastrategy.layers.plan.match import effective_styles, match_rules
from megastrategy.layers.plan.parametrized import refuse_parametrized
from megastrategy.layers.plan.resolved import FixUp, PlanEntry, ResolvedPlan, RNGRegion
from megastrategy.layers.plan.sizes import SizePass
from megastrategy.layers.plan.ties import resolve_ties
from megastrategy.layers.plan.units import active_units

__all__ = ["resolve_tp_plan"]


def resolve_tp_plan(module: nn.Module, tp_plan: dict[str, str] | None, tp_size: int) -> ResolvedPlan:
    """Decide, without touching ``module`` or any process group, how it is tensor-parallelized.

    See the module docstring for the ``tp_plan`` format and the precedence rule. Raises
    :class:`MegatronConfigError` for: an unknown style, a glob that matches nothing, a style
    that does not fit the module, ambiguous globs, sizes ``tp`` does not divide (heads,
    hidden/FFN sizes), weight ties that cannot survive sharding, a model in which
    auto-detection finds nothing to shard or an unclassifiable layer in a repeated block.
    """
    ctx = PlanContext.of(module, tp_plan, tp_size)
    effective = effective_styles(ctx, match_rules(ctx))
    drafts = draft_entries(ctx, effective)
    units = replicate_kv_heads(ctx.tp_size, drafts, active_units(ctx.detection, drafts))
    check_coverage(ctx, effective, drafts)
    add_known_replicated(ctx, effective, drafts)
    drop_inside_attention(drafts)
    refuse_parametrized(ctx, drafts)
    add_layout(ctx, drafts)
    resolve_ties(module, ctx.modules, drafts)
    fixups = SizePass(ctx).run(drafts, units)
    return _freeze(ctx, drafts, units, fixups)


def _freeze(
    ctx: PlanContext, drafts: Drafts, units: list[BuiltinUnit], fixups: dict[tuple[str, str], FixUp]
) -> ResolvedPlan:
    """The public, immutable plan: entries in ``named_modules()`` order."""
    order = {n: i for i, n in enumerate(ctx.names)}
    entries = tuple(
        PlanEntry(name=n, style=d.style, module_type=type_name(ctx.modules[n]), extra=d.extra(), source=d.source)
        for n, d in sorted(drafts.items(), key=lambda kv: order[kv[0]])
    )
    rng_regions = tuple(
        RNGRegion(u.owner, u.rng_region[0], u.rng_region[1]) for u in units if u.rng_region is not None
    )
    return ResolvedPlan(
        tp_size=ctx.tp_size,
        entries=entries,
        fixups=tuple(fixups.values()),
        rng_regions=rng_regions,
        architectures=tuple(dict.fromkeys(u.arch for u in units)),
        auto=ctx.auto_mode,
        tp_plan=dict(ctx.tp_plan) if ctx.tp_plan is not None else None,
    )
