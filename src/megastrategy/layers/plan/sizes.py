"""The size pass: every size the sharding splits must be divisible by ``tp``, and the
attributes that count heads are divided by ``tp`` on the modules whose forward reads them
(fix-ups), since the user's forward runs unchanged on the local heads."""
from __future__ import annotations

import math

from torch import nn

from megastrategy.divisors import divisors
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.unit_types import HEAD_ATTRS, BuiltinUnit, SizeCheck
from megastrategy.layers.plan.context import PlanContext
from megastrategy.layers.plan.dotted_attrs import get_dotted
from megastrategy.layers.plan.drafts import DraftEntry, Drafts
from megastrategy.layers.plan.layer_kinds import features, is_linear
from megastrategy.layers.plan.resolved import FixUp
from megastrategy.naming import parent_name

__all__ = ["HEAD_ATTRS", "SizePass"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SizePass:
    """Collects size checks and fix-ups over the active units and the entries, then checks
    them all at once so that the error can list every ``tp`` that would work."""

    def __init__(self, ctx: PlanContext) -> None:
        self.ctx = ctx
        self.checks: list[tuple[SizeCheck, str]] = []  # (check, argument that fixes it)
        self.fixups: dict[tuple[str, str], FixUp] = {}

    def run(self, drafts: Drafts, units: list[BuiltinUnit]) -> dict[tuple[str, str], FixUp]:
        for unit in units:
            self._unit(unit)
        unit_owners = {u.owner for u in units if u.divide_attrs}
        for n, d in drafts.items():
            self._entry(n, d, unit_owners)
        _check_divisibility(self.checks, self.ctx.tp_size)
        self._nested_tensor_fixups(drafts)
        return self.fixups

    def _fix(self, owner: str, attr: str, value: int, what: str, reason: str) -> None:
        self.checks.append((SizeCheck(owner, attr, value, what), "tp"))
        self.fixups[(owner, attr)] = FixUp(owner, attr, value, value // self.ctx.tp_size, reason)

    def _unit(self, unit: BuiltinUnit) -> None:
        for c in unit.checks:
            self.checks.append((c, "tp"))
        owner_mod = self.ctx.submodule(unit.owner)
        for attr in unit.divide_attrs:
            value = get_dotted(owner_mod, attr)
            if _is_int(value):
                self._fix(unit.owner, attr, value, "local heads/size", f"{unit.arch} {unit.kind}: local heads")
        for attr, new in unit.set_attrs:
            value = get_dotted(owner_mod, attr)
            if _is_int(value) and value != new:
                self.fixups[(unit.owner, attr)] = FixUp(
                    unit.owner, attr, value, new, f"{unit.arch} {unit.kind}: key/value heads replicated")

    def _entry(self, n: str, d: DraftEntry, unit_owners: set[str]) -> None:
        m = self.ctx.modules[n]
        if d.style in ("column", "row") and is_linear(m):
            self._linear(n, d, m)
            if d.style == "column" and d.unit is None and parent_name(n) not in unit_owners:
                self._head_attrs(n)
        elif d.style == "attention":
            self.checks.append((SizeCheck(n, "num_heads", int(m.num_heads), "attention heads"), "tp"))
            self.checks.append((SizeCheck(n, "embed_dim", int(m.embed_dim), "embedding size"), "tp"))

    def _linear(self, n: str, d: DraftEntry, m: nn.Module) -> None:
        fin, fout = features(m)
        chunks = d.chunks
        if d.style != "column":
            self.checks.append((SizeCheck(n, "in_features", fin, "input features"), "tp"))
            return
        if d.packed_sections:
            self._sections(n, fout, tuple(d.packed_sections))
            return
        if fout % chunks:
            raise MegatronConfigError(
                f"{n}: out_features={fout} is not a multiple of packed_chunks={chunks} (a packed "
                f"projection holds {chunks} equal chunks side by side)."
            )
        what = "out_features" if chunks == 1 else f"out_features/{chunks} (one packed chunk)"
        self.checks.append((SizeCheck(n, what, fout // chunks, "output features"), "tp"))

    def _sections(self, n: str, fout: int, sections: tuple[int, ...]) -> None:
        """Unequal packed projections: each section is split evenly over ``tp`` on its own."""
        if sum(sections) != fout:
            raise MegatronConfigError(
                f"{n}: out_features={fout} is not the sum of packed_sections={sections} (a packed "
                "projection holds its sections side by side)."
            )
        for i, size in enumerate(sections):
            self.checks.append((SizeCheck(n, f"out_features section {i} of {sections}", size, "output features"), "tp"))

    def _head_attrs(self, n: str) -> None:
        """A user-planned column layer: its parent's head-count attributes are divided."""
        parent = parent_name(n)
        pmod = self.ctx.submodule(parent)
        for attr in HEAD_ATTRS:
            value = getattr(pmod, attr, None)
            if _is_int(value) and (parent, attr) not in self.fixups:
                self._fix(parent, attr, value, "heads/head-derived size", f"parent of column-sharded {n}")

    def _nested_tensor_fixups(self, drafts: Drafts) -> None:
        """nn.TransformerEncoder's nested-tensor fast path reads the layers' full weights."""
        for n, m in [("", self.ctx.module)] + self.ctx.named:
            if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
                prefix = n + "." if n else ""
                if any(x.startswith(prefix) and d.style == "attention" for x, d in drafts.items()):
                    self.fixups[(n, "use_nested_tensor")] = FixUp(
                        n, "use_nested_tensor", True, False, "the nested-tensor fast path needs full weights"
                    )


def _check_divisibility(checks: list[tuple[SizeCheck, str]], tp_size: int) -> None:
    if tp_size == 1 or not checks:
        return
    g = 0
    for c, _ in checks:
        g = math.gcd(g, int(c.value))
    valid = divisors(g) if g else [1]
    for c, arg in checks:
        if c.value % tp_size:
            owner = c.owner or "<root>"
            raise MegatronConfigError(
                f"{arg}={tp_size} does not divide {c.attr}={c.value} of {owner} ({c.what} are split evenly "
                f"across the tensor-parallel ranks); use {arg} in {{{', '.join(str(v) for v in valid)}}}."
                + (f" {c.advice}" if c.advice else "")
            )
