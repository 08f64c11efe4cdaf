"""What every resolution pass reads: the module, its named submodules, the parsed rules and
the built-in detection, gathered once so that the passes take one argument, not eight."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.builtin_plans import BuiltinDetection, detect_builtin_plan
from megastrategy.layers.plan.rules import AUTO, Rule, parse_tp_plan

__all__ = ["PlanContext"]


@dataclass
class PlanContext:
    """Read-only inputs of :func:`~megastrategy.layers.plan.resolve_tp_plan` (the passes never
    modify it; ``rules[i].matches`` is filled by the match pass)."""

    module: nn.Module
    tp_plan: Mapping[str, str] | None
    tp_size: int
    named: list[tuple[str, nn.Module]]
    modules: dict[str, nn.Module]
    names: list[str]
    rules: list[Rule]
    auto_mode: bool
    detection: BuiltinDetection

    @classmethod
    def of(cls, module: Any, tp_plan: Any, tp_size: Any) -> "PlanContext":
        """Validate the arguments and gather what the passes read."""
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise MegatronConfigError(f"tp={tp_size!r} must be a positive integer (e.g. tp=2).")
        if not isinstance(module, nn.Module):
            raise MegatronConfigError(f"resolve_tp_plan needs an nn.Module, got {type(module).__name__}.")
        named = [(n, m) for n, m in module.named_modules() if n]
        rules = parse_tp_plan(tp_plan)
        auto_mode = tp_plan is None or any(r.style == AUTO for r in rules)
        return cls(
            module=module,
            tp_plan=tp_plan,
            tp_size=tp_size,
            named=named,
            modules=dict(named),
            names=[n for n, _ in named],
            rules=rules,
            auto_mode=auto_mode,
            # a user's own layer stack is traced only when asked to detect at tp > 1: a plan without
            # 'auto' is used as given, and the trace runs the model (at tp=1 nothing is sharded)
            detection=detect_builtin_plan(module, user_stacks=auto_mode and tp_size > 1),
        )

    def submodule(self, name: str) -> nn.Module:
        """``name``'s module, the root for ``""``."""
        return self.module.get_submodule(name) if name else self.module
