"""The units pass: layers of one recognized block are sharded together or not at all, because
each column-sharded output feeds the block's row-sharded layer."""
from __future__ import annotations

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.builtin_plans import BuiltinDetection, BuiltinUnit
from megastrategy.layers.plan.drafts import Drafts
from megastrategy.layers.plan.module_names import common_ancestor

__all__ = ["active_units"]


def active_units(detection: BuiltinDetection, drafts: Drafts) -> list[BuiltinUnit]:
    """The recognized blocks whose layers the plan shards the built-in way (all of them)."""
    active: list[BuiltinUnit] = []
    for unit in detection.units:
        on = [name for name, _, _ in unit.members if name in drafts and drafts[name].unit is unit]
        if not on:
            continue
        off = [(name, style) for name, style, _ in unit.members if name not in on]
        if off:
            _raise_partial_unit(unit, on, off)
        active.append(unit)
    return active


def _raise_partial_unit(unit: BuiltinUnit, on: list[str], off: list[tuple[str, str]]) -> None:
    missing = ", ".join(f"{name!r}: {style!r}" for name, style in off)
    common = common_ancestor([name for name, _, _ in unit.members])
    raise MegatronConfigError(
        f"tp_plan shards {', '.join(repr(x) for x in on)} but not {', '.join(repr(x) for x, _ in off)}: "
        f"these layers of {unit.owner!r} (a {unit.arch} {unit.kind} block) must be sharded together, "
        f"because each column-sharded output feeds the row-sharded layer; add {{{missing}}} to "
        f"tp_plan, or mark {common!r} 'replicate'."
    )
