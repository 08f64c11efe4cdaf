"""The first two passes: match every glob to module names, then pick each module's effective
style by the precedence rule (a ``replicate`` ancestor, else the most specific glob)."""
from __future__ import annotations

from collections import defaultdict
from fnmatch import fnmatchcase
from typing import NamedTuple

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan.context import PlanContext
from megastrategy.layers.plan.layer_kinds import type_name
from megastrategy.layers.plan.module_names import ancestors, close_names
from megastrategy.layers.plan.rules import AUTO, Rule, glob_specificity

__all__ = ["Effective", "match_rules", "effective_styles"]


class Effective(NamedTuple):
    """The style a module gets, the rule that gave it, and whether a ``replicate`` ancestor
    imposed it (``inherited``)."""

    style: str
    rule: Rule
    inherited: bool


def match_rules(ctx: PlanContext) -> dict[str, list[Rule]]:
    """Fill ``rule.matches``; a glob that matches nothing is an error. Returns the rules that
    match each module directly (``tp_plan=None`` is an implicit ``{"*": "auto"}``)."""
    for rule in ctx.rules:
        rule.matches = [n for n in ctx.names if fnmatchcase(n, rule.glob)]
        if not rule.matches:
            _raise_unmatched(ctx, rule)
    direct: dict[str, list[Rule]] = defaultdict(list)
    for rule in ctx.rules:
        for n in rule.matches:
            direct[n].append(rule)
    if ctx.tp_plan is None:
        implicit = Rule("*", AUTO, glob_specificity("*"), list(ctx.names))
        for n in ctx.names:
            direct[n].append(implicit)
    return direct


def _raise_unmatched(ctx: PlanContext, rule: Rule) -> None:
    close = close_names(rule.glob, ctx.names)
    hint = (
        f"close names: {', '.join(repr(c) for c in close)}"
        if close
        else f"module names look like {', '.join(repr(n) for n in ctx.names[:5])}"
    )
    raise MegatronConfigError(
        f"tp_plan[{rule.glob!r}]={rule.style!r}: the glob matches no module of "
        f"{type_name(ctx.module)} (globs are fnmatch patterns over named_modules() names, relative "
        f"to the module given to the strategy); {hint}."
    )


def effective_styles(ctx: PlanContext, direct: dict[str, list[Rule]]) -> dict[str, Effective]:
    """Each matched module's style under the precedence rule; modules nothing matches are absent."""
    replicate_direct = {n for n, rs in direct.items() if any(r.style == "replicate" for r in rs)}
    effective: dict[str, Effective] = {}
    for n in ctx.names:
        excluded_by = next((a for a in ancestors(n) if a in replicate_direct), None)
        if excluded_by is not None:
            rule = max((r for r in direct[excluded_by] if r.style == "replicate"), key=lambda r: r.spec)
            effective[n] = Effective("replicate", rule, True)
            continue
        candidates = direct.get(n)
        if candidates:
            effective[n] = _most_specific(n, candidates)
    _check_not_all_excluded(ctx.rules, effective, replicate_direct)
    return effective


def _most_specific(name: str, candidates: list[Rule]) -> Effective:
    best = max(r.spec for r in candidates)
    top = [r for r in candidates if r.spec == best]
    if len({r.style for r in top}) > 1:
        listed = ", ".join(f"{r.glob!r}: {r.style!r}" for r in top)
        raise MegatronConfigError(
            f"tp_plan: module {name!r} is matched by equally specific globs with different styles "
            f"({listed}); make one more specific (more literal characters win), e.g. name the "
            f"module exactly: {{{name!r}: {top[0].style!r}}}."
        )
    return Effective(top[0].style, top[0], False)


def _check_not_all_excluded(rules: list[Rule], effective: dict[str, Effective], replicate_direct: set[str]) -> None:
    """A sharding glob whose every match is excluded by a replicate ancestor contradicts itself."""
    for rule in rules:
        if rule.style in ("column", "row", "vocab") and all(
            n in effective and effective[n].inherited for n in rule.matches
        ):
            first = rule.matches[0]
            blocker = next(a for a in ancestors(first) if a in replicate_direct)
            raise MegatronConfigError(
                f"tp_plan[{rule.glob!r}]={rule.style!r} matches only modules beneath {blocker!r}, which a "
                f"'replicate' glob excludes together with everything beneath it; remove one of the two "
                f"entries or make the 'replicate' glob name only the modules to keep whole."
            )
