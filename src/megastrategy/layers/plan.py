"""Tensor-parallel plans: which submodules of the user's module are sharded, and how.

Two steps, so that every configuration error surfaces before any collective runs:

* :func:`resolve_tp_plan` (pure: no process group, nothing modified) reads the module and the
  user's ``tp_plan`` and returns a :class:`ResolvedPlan`, or raises
  :class:`~megastrategy.errors.MegatronConfigError`;
* :func:`apply_tp_plan` rewrites the module in place following the plan.

The ``tp_plan`` argument
------------------------
A dict mapping :func:`fnmatch.fnmatchcase` globs over the names of
``module.named_modules()`` (relative to the module passed in, e.g. the LightningModule:
``"model.bert.encoder.layer.*.attention.self.query"``; ``*`` also matches dots) to a style:

``"column"``
    ``nn.Linear`` / HF ``Conv1D``: output features split over the TP ranks
    (:class:`ColumnParallelLinear`). On an ``nn.Dropout`` it means "this dropout acts on
    column-sharded activations" and makes it draw from the per-TP-rank RNG stream
    (:class:`TensorParallelRegionDropout`).
``"row"``
    ``nn.Linear`` / ``Conv1D``: input features split, the partial outputs all-reduced
    (:class:`RowParallelLinear`); it consumes the output of column layers.
``"vocab"``
    an ``nn.Embedding`` (:class:`VocabParallelEmbedding`), or an ``nn.Linear`` / ``Conv1D``
    whose output is the vocabulary (:class:`VocabParallelHead`), possibly weight-tied to the
    embedding. The vocabulary need not be divisible by ``tp`` (it is padded).
``"replicate"``
    leave the module *and everything beneath it* alone.
``"auto"``
    use built-in detection (:mod:`megastrategy.layers.builtin_plans`) for the modules the
    glob matches. ``{"*": "auto", ...}`` is the **combined form**: auto-detection everywhere,
    overridden by the more specific entries next to it.

Precedence
----------
* ``tp_plan=None`` is auto-detection, the same as ``{"*": "auto"}``.
* A module whose ancestor is matched by a ``"replicate"`` glob is replicated, whatever else
  matches it.
* Otherwise, among the globs that match the module itself, the **most specific** wins:
  the one with the most literal (non-wildcard) characters; on a tie, the one with fewer
  wildcards (``*``, ``?``, ``[...]``). An exact name therefore beats any glob. Two
  equally specific globs with different styles are an error.
* A module no glob matches is left alone (replicated).
* A ``tp_plan`` without an ``"auto"`` entry is **used as given**, also for a model of a known
  architecture: only what it names is sharded. Where it gives a layer of a recognized block
  the same style auto-detection would, the built-in knowledge of *how* is kept (GPT-2's
  packed QKV, head-count fix-ups, per-TP-rank attention dropout); layers of one recognized
  block must then be sharded together or not at all.

Head-count fix-ups
------------------
The user's forward runs unchanged on the local heads, so attributes that count heads or
head-derived sizes are divided by ``tp`` on the module that owns the sharded projections
(:class:`FixUp`). Built-in blocks use their known attributes (BERT
``num_attention_heads``, ``all_head_size``; GPT-2 ``num_heads``, ``split_size``).
For other column-sharded layers the rule is: on the **parent module of each column-sharded
layer**, every ``int`` attribute named one of :data:`HEAD_ATTRS` is divided by ``tp`` (and
must be divisible). Shared ``config`` objects are never modified.

Auto-detection errors
---------------------
With auto-detection and ``tp > 1``, a model in which nothing is recognized is an error, and
so is an ``nn.Linear``/``Conv1D`` that auto-detection cannot classify **inside a repeated
block** (an element of an ``nn.ModuleList``/``nn.Sequential`` that is not the layer itself):
that is where the compute is, and silently replicating it would defeat tensor parallelism.
A stand-alone unrecognized layer (a classifier head, a pooler, ``head.0`` of a
``Sequential``) is cheap and stays replicated; so do the non-sharded layers of a recognized
Hugging Face model.
"""
from __future__ import annotations

import difflib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Iterable, Mapping

from torch import nn

from megastrategy.divisors import divisors
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.builtin_plans import (
    KNOWN_ARCHITECTURES,
    BuiltinDetection,
    BuiltinUnit,
    SizeCheck,
    detect_builtin_plan,
    is_conv1d,
)
from megastrategy.naming import join_name, parent_name

__all__ = [
    "STYLES",
    "HEAD_ATTRS",
    "PlanEntry",
    "FixUp",
    "RNGRegion",
    "ResolvedPlan",
    "resolve_tp_plan",
    "apply_tp_plan",
    "glob_specificity",
]

STYLES = ("column", "row", "vocab", "replicate")
#: accepted as a ``tp_plan`` value besides :data:`STYLES`
AUTO = "auto"
#: styles of resolved entries that only auto-detection produces
BUILTIN_ONLY_STYLES = ("attention", "dropout")
#: integer attributes divided by tp on the parent of a column-sharded layer (user plans)
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
_SHARDED_STYLES = ("column", "row", "vocab", "attention")
_HF_STYLE_NAMES = {
    "colwise": "column",
    "col": "column",
    "columnwise": "column",
    "rowwise": "row",
    "embedding": "vocab",
    "replicated": "replicate",
    "none": "replicate",
}


# ----------------------------------------------------------------------------------------------
# The resolved plan
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanEntry:
    """One module and what happens to it.

    ``style``: ``column``, ``row``, ``vocab``, ``replicate``, or (auto-detection only)
    ``attention`` (an ``nn.MultiheadAttention`` replaced by
    ``TensorParallelMultiheadAttention``) and ``dropout`` (an ``nn.Dropout`` on sharded
    activations, replaced by ``TensorParallelRegionDropout``).

    ``extra`` (a dict; treat it as read-only), keys present when relevant:
    ``packed_chunks`` (int > 1), ``weight_layout`` (``"in_out"`` for HF ``Conv1D``),
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


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def _common_ancestor(names: list[str]) -> str:
    """Deepest module that is an ancestor of (or equal to the parent of) every name."""
    split = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _ancestors(name: str) -> Iterable[str]:
    """Strict ancestors, nearest first (the root ``""`` excluded)."""
    while "." in name:
        name = name.rsplit(".", 1)[0]
        yield name


def glob_specificity(glob: str) -> tuple[int, int]:
    """``(literal characters, -wildcards)``: larger is more specific (see module docs)."""
    literal = wild = 0
    i = 0
    while i < len(glob):
        c = glob[i]
        if c in "*?":
            wild += 1
            i += 1
        elif c == "[":
            j = i + 1
            if j < len(glob) and glob[j] == "!":
                j += 1
            if j < len(glob) and glob[j] == "]":
                j += 1
            j = glob.find("]", j)
            if j == -1:
                literal += 1
                i += 1
            else:
                wild += 1
                i = j + 1
        else:
            literal += 1
            i += 1
    return (literal, -wild)


def _type_name(m: nn.Module) -> str:
    return type(m).__name__


def _features(m: nn.Module) -> tuple[int, int]:
    """``(in, out)`` of an ``nn.Linear`` or HF ``Conv1D``."""
    if is_conv1d(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return int(m.in_features), int(m.out_features)


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def _is_weight_layer(m: nn.Module) -> bool:
    return _is_linear(m) or isinstance(m, (nn.Embedding, nn.MultiheadAttention))


def _globify(name: str) -> str:
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def _close_names(query: str, names: list[str], n: int = 5) -> list[str]:
    candidates = list(dict.fromkeys(names + [_globify(x) for x in names]))
    close = difflib.get_close_matches(query, candidates, n=n, cutoff=0.6)
    if not close:
        tail = query.rsplit(".", 1)[-1]
        close = [c for c in candidates if c.rsplit(".", 1)[-1] == tail][:n]
    if not close:
        close = difflib.get_close_matches(query, candidates, n=n, cutoff=0.3)
    return close


def _style_fits(style: str, m: nn.Module) -> bool:
    if style == "column":
        return _is_linear(m) or isinstance(m, nn.Dropout)
    if style == "row":
        return _is_linear(m)
    if style == "vocab":
        return _is_linear(m) or isinstance(m, nn.Embedding)
    return True


def _style_hint(m: nn.Module) -> str:
    if isinstance(m, nn.Embedding):
        return "an nn.Embedding takes 'vocab' or 'replicate'"
    if _is_linear(m):
        return "a linear layer takes 'column', 'row', 'vocab' (output = vocabulary) or 'replicate'"
    if isinstance(m, nn.Dropout):
        return "an nn.Dropout takes 'column' (acts on column-sharded activations) or 'replicate'"
    if isinstance(m, nn.MultiheadAttention):
        return "an nn.MultiheadAttention takes 'auto' (sharded by heads) or 'replicate'"
    return (
        f"a container ({_type_name(m)}) takes only 'replicate' or 'auto'; name its nn.Linear/"
        "nn.Embedding children instead (narrow the glob, e.g. end it with the layer's attribute name)"
    )


@dataclass
class _Rule:
    glob: str
    style: str
    spec: tuple[int, int]
    matches: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        return f"tp_plan[{self.glob!r}]"


# ----------------------------------------------------------------------------------------------
# resolve
# ----------------------------------------------------------------------------------------------
def resolve_tp_plan(module: nn.Module, tp_plan: dict[str, str] | None, tp_size: int) -> ResolvedPlan:
    """Decide, without touching ``module`` or any process group, how it is tensor-parallelized.

    See the module docstring for the ``tp_plan`` format and the precedence rule. Raises
    :class:`MegatronConfigError` for: an unknown style, a glob that matches nothing, a style
    that does not fit the module, ambiguous globs, sizes ``tp`` does not divide (heads,
    hidden/FFN sizes), weight ties that cannot survive sharding, a model in which
    auto-detection finds nothing to shard or an unclassifiable layer in a repeated block.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise MegatronConfigError(f"tp={tp_size!r} must be a positive integer (e.g. tp=2).")
    if not isinstance(module, nn.Module):
        raise MegatronConfigError(f"resolve_tp_plan needs an nn.Module, got {type(module).__name__}.")

    named = [(n, m) for n, m in module.named_modules() if n]
    modules = dict(named)
    names = [n for n, _ in named]

    rules = _parse_tp_plan(tp_plan)
    auto_mode = tp_plan is None or any(r.style == AUTO for r in rules)
    detection = detect_builtin_plan(module)
    member_index = detection.member_index()

    # -- match every glob; unmatched globs are errors ----------------------------------------
    for rule in rules:
        rule.matches = [n for n in names if fnmatchcase(n, rule.glob)]
        if not rule.matches:
            close = _close_names(rule.glob, names)
            hint = (
                f"close names: {', '.join(repr(c) for c in close)}"
                if close
                else f"module names look like {', '.join(repr(n) for n in names[:5])}"
            )
            raise MegatronConfigError(
                f"tp_plan[{rule.glob!r}]={rule.style!r}: the glob matches no module of "
                f"{_type_name(module)} (globs are fnmatch patterns over named_modules() names, relative "
                f"to the module given to the strategy); {hint}."
            )

    direct: dict[str, list[_Rule]] = defaultdict(list)
    for rule in rules:
        for n in rule.matches:
            direct[n].append(rule)
    if tp_plan is None:
        implicit = _Rule("*", AUTO, glob_specificity("*"), list(names))
        for n in names:
            direct[n].append(implicit)

    # -- effective rule per module -----------------------------------------------------------
    replicate_direct = {n for n, rs in direct.items() if any(r.style == "replicate" for r in rs)}
    effective: dict[str, tuple[str, _Rule, bool]] = {}  # name -> (style, rule, inherited)
    for n in names:
        excluded_by = next((a for a in _ancestors(n) if a in replicate_direct), None)
        if excluded_by is not None:
            rule = max(
                (r for r in direct[excluded_by] if r.style == "replicate"), key=lambda r: r.spec
            )
            effective[n] = ("replicate", rule, True)
            continue
        candidates = direct.get(n)
        if not candidates:
            continue
        best = max(r.spec for r in candidates)
        top = [r for r in candidates if r.spec == best]
        if len({r.style for r in top}) > 1:
            listed = ", ".join(f"{r.glob!r}: {r.style!r}" for r in top)
            raise MegatronConfigError(
                f"tp_plan: module {n!r} is matched by equally specific globs with different styles "
                f"({listed}); make one more specific (more literal characters win), e.g. name the "
                f"module exactly: {{{n!r}: {top[0].style!r}}}."
            )
        effective[n] = (top[0].style, top[0], False)

    # a sharding glob whose every match is excluded by a replicate ancestor contradicts itself
    for rule in rules:
        if rule.style in ("column", "row", "vocab") and all(
            effective.get(n, ("", None, False))[2] for n in rule.matches
        ):
            first = rule.matches[0]
            blocker = next(a for a in _ancestors(first) if a in replicate_direct)
            raise MegatronConfigError(
                f"tp_plan[{rule.glob!r}]={rule.style!r} matches only modules beneath {blocker!r}, which a "
                f"'replicate' glob excludes together with everything beneath it; remove one of the two "
                f"entries or make the 'replicate' glob name only the modules to keep whole."
            )

    # -- entries -----------------------------------------------------------------------------
    raw: dict[str, dict[str, Any]] = {}  # name -> {"style","extra","source","unit"}
    for n in names:
        if n not in effective:
            continue
        style, rule, inherited = effective[n]
        m = modules[n]
        if style == "replicate":
            if _is_weight_layer(m):
                raw[n] = {"style": "replicate", "extra": {}, "source": rule.source, "unit": None}
            continue
        if style == AUTO:
            hit = member_index.get(n)
            if hit is not None:
                unit, bstyle, bextra = hit
                raw[n] = {
                    "style": bstyle,
                    "extra": dict(bextra),
                    "source": f"auto:{unit.arch}",
                    "unit": unit,
                }
            continue
        # an explicit sharding style from the user
        if not _style_fits(style, m):
            raise MegatronConfigError(
                f"tp_plan[{rule.glob!r}]={style!r} matches {n!r} (type {_type_name(m)}): style {style!r} "
                f"does not apply to it; {_style_hint(m)}."
            )
        hit = member_index.get(n)
        if style == "column" and isinstance(m, nn.Dropout):
            style = "dropout"
        if hit is not None and hit[1] == style:
            unit, _, bextra = hit
            raw[n] = {"style": style, "extra": dict(bextra), "source": rule.source, "unit": unit}
        else:
            raw[n] = {"style": style, "extra": {}, "source": rule.source, "unit": None}

    # -- built-in units: all members or none ---------------------------------------------------
    active_units: list[BuiltinUnit] = []
    for unit in detection.units:
        on = [name for name, style, _ in unit.members if raw.get(name, {}).get("unit") is unit]
        if not on:
            continue
        off = [(name, style) for name, style, _ in unit.members if name not in on]
        if off:
            missing = ", ".join(f"{name!r}: {style!r}" for name, style in off)
            common = _common_ancestor([name for name, _, _ in unit.members])
            raise MegatronConfigError(
                f"tp_plan shards {', '.join(repr(x) for x in on)} but not {', '.join(repr(x) for x, _ in off)}: "
                f"these layers of {unit.owner!r} (a {unit.arch} {unit.kind} block) must be sharded together, "
                f"because each column-sharded output feeds the row-sharded layer; add {{{missing}}} to "
                f"tp_plan, or mark {common!r} 'replicate'."
            )
        active_units.append(unit)

    # -- unclassified layers under auto-detection -------------------------------------------
    if auto_mode and tp_size > 1:
        _check_unclassified(module, names, modules, effective, raw, detection, tp_plan, tp_size)

    sharded_names = [n for n, r in raw.items() if r["style"] != "replicate"]
    if tp_size > 1 and not sharded_names:
        _raise_nothing_to_shard(module, names, modules, tp_plan, tp_size)

    # -- known-replicated layers (for the table) --------------------------------------------
    mha_names = [n for n, r in raw.items() if r["style"] == "attention"]
    for n in names:
        if n in raw or not _is_weight_layer(modules[n]):
            continue
        if any(n.startswith(a + ".") for a in mha_names):
            continue
        root = _recognized_root(n, detection)
        if effective.get(n, ("",))[0] != AUTO:
            source = "default"
        elif root is not None:
            source = f"auto:{detection.recognized_roots[root]}"
        else:
            source = "auto"
        raw[n] = {"style": "replicate", "extra": {}, "source": source, "unit": None}

    # a user rule may not reach inside a module that is replaced as a whole
    for n in list(raw):
        for a in mha_names:
            if n.startswith(a + ".") and raw[n]["style"] != "replicate":
                raise MegatronConfigError(
                    f"tp_plan: {n!r} lies inside {a!r}, an nn.MultiheadAttention that is sharded as a whole "
                    f"(by heads); drop the entry for {n!r} or mark {a!r} 'replicate'."
                )
            if n.startswith(a + "."):
                raw.pop(n)
                break

    # -- extras: layout, vocab kind, shared input copies ---------------------------------------
    for n, r in raw.items():
        m = modules[n]
        if r["style"] in ("column", "row", "vocab") and is_conv1d(m):
            r["extra"]["weight_layout"] = "in_out"
        if r["style"] == "vocab":
            r["extra"]["vocab_layer"] = "embedding" if isinstance(m, nn.Embedding) else "head"
        if r["unit"] is not None:
            r["extra"]["unit"] = f"{r['unit'].arch}.{r['unit'].kind}"
    by_parent: dict[str, list[str]] = defaultdict(list)
    for n, r in raw.items():
        if r["style"] == "column" and _is_linear(modules[n]):
            by_parent[parent_name(n)].append(n)
    for parent, members in by_parent.items():
        if len(members) > 1:
            for n in members:
                raw[n]["extra"]["input_copy"] = parent

    # -- ties ----------------------------------------------------------------------------------
    _resolve_ties(module, modules, raw)

    # -- divisibility checks and fix-ups -------------------------------------------------------
    checks: list[tuple[SizeCheck, str]] = []  # (check, argument that fixes it)
    fixups: dict[tuple[str, str], FixUp] = {}
    unit_owners = {u.owner for u in active_units if u.divide_attrs}
    for unit in active_units:
        for c in unit.checks:
            checks.append((c, "tp"))
        owner_mod = module.get_submodule(unit.owner) if unit.owner else module
        for attr in unit.divide_attrs:
            value = getattr(owner_mod, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                checks.append((SizeCheck(unit.owner, attr, value, "local heads/size"), "tp"))
                fixups[(unit.owner, attr)] = FixUp(
                    unit.owner, attr, value, value // tp_size, f"{unit.arch} {unit.kind}: local heads"
                )
    for n, r in raw.items():
        m = modules[n]
        style = r["style"]
        if style in ("column", "row") and _is_linear(m):
            fin, fout = _features(m)
            chunks = int(r["extra"].get("packed_chunks", 1))
            if style == "column":
                if fout % chunks:
                    raise MegatronConfigError(
                        f"{n}: out_features={fout} is not a multiple of packed_chunks={chunks} (a packed "
                        f"projection holds {chunks} equal chunks side by side)."
                    )
                what = "out_features" if chunks == 1 else f"out_features/{chunks} (one packed chunk)"
                checks.append((SizeCheck(n, what, fout // chunks, "output features"), "tp"))
            else:
                checks.append((SizeCheck(n, "in_features", fin, "input features"), "tp"))
            if style == "column" and r["unit"] is None:
                parent = parent_name(n)
                if parent in unit_owners:
                    continue
                pmod = module.get_submodule(parent) if parent else module
                for attr in HEAD_ATTRS:
                    value = getattr(pmod, attr, None)
                    if isinstance(value, int) and not isinstance(value, bool) and (parent, attr) not in fixups:
                        checks.append((SizeCheck(parent, attr, value, "heads/head-derived size"), "tp"))
                        fixups[(parent, attr)] = FixUp(
                            parent, attr, value, value // tp_size, f"parent of column-sharded {n}"
                        )
        elif style == "attention":
            checks.append((SizeCheck(n, "num_heads", int(m.num_heads), "attention heads"), "tp"))
            checks.append((SizeCheck(n, "embed_dim", int(m.embed_dim), "embedding size"), "tp"))
    _check_divisibility(checks, tp_size)

    # nn.TransformerEncoder's nested-tensor fast path reads the layers' full weights
    for n, m in [("", module)] + named:
        if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
            prefix = n + "." if n else ""
            if any(x.startswith(prefix) and r["style"] == "attention" for x, r in raw.items()):
                fixups[(n, "use_nested_tensor")] = FixUp(
                    n, "use_nested_tensor", True, False, "the nested-tensor fast path needs full weights"
                )

    rng_regions = tuple(
        RNGRegion(u.owner, u.rng_region[0], u.rng_region[1]) for u in active_units if u.rng_region is not None
    )

    order = {n: i for i, n in enumerate(names)}
    entries = tuple(
        PlanEntry(
            name=n,
            style=r["style"],
            module_type=_type_name(modules[n]),
            extra=dict(r["extra"]),
            source=r["source"],
        )
        for n, r in sorted(raw.items(), key=lambda kv: order[kv[0]])
    )
    return ResolvedPlan(
        tp_size=tp_size,
        entries=entries,
        fixups=tuple(fixups.values()),
        rng_regions=rng_regions,
        architectures=tuple(dict.fromkeys(u.arch for u in active_units)),
        auto=auto_mode,
        tp_plan=dict(tp_plan) if tp_plan is not None else None,
    )


def _parse_tp_plan(tp_plan: Any) -> list[_Rule]:
    if tp_plan is None:
        return []
    if not isinstance(tp_plan, Mapping):
        raise MegatronConfigError(
            f"tp_plan={tp_plan!r} must be a dict mapping module-name globs to styles, e.g. "
            "{'blocks.*.attn.q': 'column', 'blocks.*.attn.proj': 'row'}, or None for auto-detection."
        )
    rules = []
    allowed = STYLES + (AUTO,)
    for glob, style in tp_plan.items():
        if not isinstance(glob, str) or not glob:
            raise MegatronConfigError(
                f"tp_plan key {glob!r} must be a non-empty string (an fnmatch glob over module names)."
            )
        if not isinstance(style, str) or style not in allowed:
            suggestion = _HF_STYLE_NAMES.get(str(style).lower()) if isinstance(style, str) else None
            if suggestion is None and isinstance(style, str):
                close = difflib.get_close_matches(style.lower(), allowed, n=1, cutoff=0.5)
                suggestion = close[0] if close else None
            hint = f"; did you mean {suggestion!r}?" if suggestion else ""
            raise MegatronConfigError(
                f"tp_plan[{glob!r}]={style!r} is not a tensor-parallel style; use one of "
                f"{', '.join(repr(s) for s in allowed)}{hint}"
            )
        rules.append(_Rule(glob, style, glob_specificity(glob)))
    return rules


def _recognized_root(name: str, detection: BuiltinDetection) -> str | None:
    best = None
    for root in detection.recognized_roots:
        if root == "" or name.startswith(root + "."):
            if best is None or len(root) > len(best):
                best = root
    return best


def _in_repeated_block(name: str, modules: dict[str, nn.Module], root: nn.Module) -> bool:
    """Is ``name`` strictly inside an element of an ``nn.ModuleList``/``nn.Sequential``?"""
    parts = name.split(".")
    for i in range(len(parts) - 1):  # element = parts[: i+1], must not be the layer itself
        container_name = ".".join(parts[:i])
        container = modules.get(container_name) if container_name else root
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and parts[i].isdigit():
            return True
    return False


def _check_unclassified(module, names, modules, effective, raw, detection, tp_plan, tp_size) -> None:
    mha = [n for n, r in raw.items() if r["style"] == "attention"]
    torch_layers = [
        n for n in names if isinstance(modules[n], (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
    ]
    unclassified = []
    for n in names:
        m = modules[n]
        if not _is_linear(m) or n in raw:
            continue
        if effective.get(n, ("",))[0] != AUTO:
            continue
        if _recognized_root(n, detection) is not None:
            continue
        if any(n.startswith(a + ".") for a in mha + torch_layers):
            continue
        if _in_repeated_block(n, modules, module):
            unclassified.append(n)
    if not unclassified:
        return
    globs = list(dict.fromkeys(_globify(n) for n in unclassified))
    blocks = list(dict.fromkeys(_globify(parent_name(n)) for n in unclassified))
    example = ", ".join(f"{g!r}: '<column|row|replicate>'" for g in globs[:8])
    more = f" (and {len(globs) - 8} more)" if len(globs) > 8 else ""
    mode = "tp_plan=None" if tp_plan is None else "an 'auto' entry in tp_plan"
    found = (
        f"it recognized {', '.join(detection.architectures)} blocks but"
        if detection.units
        else "it recognized no known block and"
    )
    raise MegatronConfigError(
        f"tp={tp_size} with auto-detection ({mode}): "
        f"{found} cannot classify the linear layers "
        f"{', '.join(repr(g) for g in globs[:8])}{more} inside repeated block(s) "
        f"{', '.join(repr(b) for b in blocks[:4])}; replicating them would leave the bulk of the model "
        f"unsharded. Name them in tp_plan and keep auto-detection for the rest, e.g. "
        f"tp_plan={{'*': 'auto', {example}}} -- 'column' for layers whose output is split (q/k/v, the "
        f"first FFN layer), 'row' for the layer consuming a split input (attention output projection, "
        f"second FFN layer), 'replicate' to keep a layer whole."
    )


def _raise_nothing_to_shard(module, names, modules, tp_plan, tp_size) -> None:
    linears = [n for n in names if _is_linear(modules[n]) or isinstance(modules[n], nn.Embedding)]
    globs = list(dict.fromkeys(_globify(n) for n in linears))
    example = ", ".join(f"{g!r}: '<column|row|vocab|replicate>'" for g in globs[:6])
    if tp_plan is None:
        raise MegatronConfigError(
            f"tp={tp_size} with tp_plan=None: auto-detection found nothing to shard in "
            f"{_type_name(module)} (known: {'; '.join(KNOWN_ARCHITECTURES)}). Pass tp_plan naming the layers "
            f"to shard, e.g. tp_plan={{'blocks.*.attn.q': 'column', 'blocks.*.attn.k': 'column', "
            f"'blocks.*.attn.v': 'column', 'blocks.*.attn.proj': 'row', 'blocks.*.mlp.fc1': 'column', "
            f"'blocks.*.mlp.fc2': 'row', 'wte': 'vocab'}}; this model's layers: "
            f"{{{example}}}" + (" ..." if len(globs) > 6 else "")
        )
    raise MegatronConfigError(
        f"tp={tp_size} with tp_plan={dict(tp_plan)!r}: the plan shards nothing (every layer it names is "
        f"'replicate' or unrecognized under 'auto'); give some nn.Linear layers 'column'/'row' "
        f"(or nn.Embedding 'vocab'), e.g. {{{example}}}, or use tp=1."
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
            )


def _resolve_ties(module: nn.Module, modules: dict[str, nn.Module], raw: dict[str, dict[str, Any]]) -> None:
    """Record vocab-head/embedding ties and BERT-style bias aliases; reject other ties."""
    all_modules = dict(module.named_modules(remove_duplicate=False))
    canonical = {id(m): n for n, m in module.named_modules()}
    holders: dict[int, list[str]] = defaultdict(list)
    for pn, p in module.named_parameters(remove_duplicate=False):
        holders[id(p)].append(pn)

    def owner_of(pname: str) -> tuple[nn.Module, str, str]:
        mod_name, _, attr = pname.rpartition(".")
        mod = all_modules[mod_name] if mod_name else module
        return mod, canonical.get(id(mod), mod_name), attr

    vocab_emb = {n for n, r in raw.items() if r["style"] == "vocab" and isinstance(modules[n], nn.Embedding)}
    vocab_head = {n for n, r in raw.items() if r["style"] == "vocab" and n not in vocab_emb}

    for n, r in raw.items():
        if r["style"] not in _SHARDED_STYLES:
            continue
        m = modules[n]
        for local, p in m.named_parameters():
            others = []
            for pn in holders[id(p)]:
                mod, cname, attr = owner_of(pn)
                if mod is m or cname == n or cname.startswith(n + "."):
                    continue
                others.append((cname, attr, pn))
            if not others:
                continue
            if n in vocab_head and local == "weight":
                embs = {c for c, a, _ in others if c in vocab_emb and a == "weight"}
                rest = [pn for c, a, pn in others if not (c in vocab_emb and a == "weight")]
                if len(embs) == 1 and not rest:
                    r["extra"]["tied_to"] = next(iter(embs))
                    continue
                emb_names = [c for c, a, _ in others]
                raise MegatronConfigError(
                    f"{n}.weight (a 'vocab' head) is tied to {', '.join(repr(x) for x in emb_names)}, which "
                    f"{'is' if len(emb_names) == 1 else 'are'} not a vocab-sharded nn.Embedding; a tied head "
                    f"and its embedding must both be 'vocab': add {{{emb_names[0]!r}: 'vocab'}} to tp_plan "
                    f"(or mark both 'replicate')."
                )
            if n in vocab_head and local == "bias":
                parent = parent_name(n)
                aliases = [a for c, a, _ in others if c == parent]
                rest = [pn for c, a, pn in others if c != parent]
                if not rest:
                    r["extra"]["bias_aliases"] = tuple(aliases)
                    continue
                raise MegatronConfigError(
                    f"{n}.bias (a 'vocab' head) is shared with {', '.join(rest)}; only an alias on the head's "
                    f"parent module (as in Hugging Face BERT's `predictions.bias`) can follow the sharding. "
                    f"Untie it or mark {n!r} 'replicate'."
                )
            if n in vocab_emb and local == "weight":
                bad = [pn for c, a, pn in others if not (c in vocab_head and a == "weight")]
                if not bad:
                    continue  # the head's side records the tie
                raise MegatronConfigError(
                    f"{n}.weight (a 'vocab' embedding) is tied to {', '.join(bad)}, which is not a 'vocab' head; "
                    f"a weight shared with the embedding must be sharded the same way: mark "
                    f"{bad[0].rpartition('.')[0]!r} 'vocab' in tp_plan (or mark both 'replicate')."
                )
            shared = ", ".join(pn for _, _, pn in others)
            raise MegatronConfigError(
                f"{n}.{local} ({r['style']!r}) is the same Parameter as {shared}; only a vocab head tied to its "
                f"vocab embedding can stay tied under tensor parallelism. Untie the parameters, or mark "
                f"{n!r} and the module holding {others[0][2]!r} 'replicate' in tp_plan."
            )


# ----------------------------------------------------------------------------------------------
# apply
# ----------------------------------------------------------------------------------------------
class _RNGRegionHooks:
    """Enter ``tracker.fork()`` at the owner's forward pre-hook, leave it at the pre-hook of
    ``until`` (if any) or when the owner's forward ends (also on an exception)."""

    def __init__(self, tracker, dropout_p: str) -> None:
        self.tracker = tracker
        self.dropout_p = dropout_p
        self._open: list[Any] = []

    def _p(self, module: nn.Module) -> float:
        value: Any = module
        for part in self.dropout_p.split("."):
            value = getattr(value, part, 0.0)
        try:
            return float(value)
        except (TypeError, ValueError):
            return 0.0

    def enter(self, module: nn.Module, args: Any) -> None:
        if module.training and self._p(module) > 0.0:
            cm = self.tracker.fork()
            cm.__enter__()
            self._open.append(cm)
        else:
            self._open.append(None)

    def leave_early(self, module: nn.Module, args: Any) -> None:
        if self._open and self._open[-1] is not None:
            cm, self._open[-1] = self._open[-1], None
            cm.__exit__(None, None, None)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        cm = self._open.pop() if self._open else None
        if cm is not None:
            cm.__exit__(None, None, None)


def apply_tp_plan(module: nn.Module, plan: ResolvedPlan, *, group, rng_tracker) -> None:
    """Rewrite ``module`` in place following ``plan`` (from :func:`resolve_tp_plan`).

    Sharded layers are built from the user's layers (their weights are sliced, never
    re-initialized) and set on every parent that holds them. Ties (a vocab head sharing its
    embedding's weight; a head bias aliased on its parent, as Hugging Face BERT does) are
    checked by Parameter identity before anything is replaced and hold one Parameter after.
    Column layers under one parent share a ``SharedInputCopy``. Attribute fix-ups are set and
    attention-dropout regions are hooked to ``rng_tracker.fork()``.

    ``rng_tracker`` may be ``None`` only if the plan has no dropout on sharded activations.
    Hugging Face ``model.tie_weights()`` afterwards re-assigns the same sharded Parameter
    (harmless); ``resize_token_embeddings`` is not supported on a sharded model.
    """
    import torch.distributed as dist

    from megastrategy.layers.embedding import VocabParallelEmbedding
    from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear
    from megastrategy.layers.mappings import SharedInputCopy

    if not isinstance(plan, ResolvedPlan):
        raise MegatronConfigError(f"plan={plan!r} must be a ResolvedPlan from resolve_tp_plan().")
    world = dist.get_world_size(group)
    if world != plan.tp_size:
        raise MegatronConfigError(
            f"plan was resolved for tp={plan.tp_size} but group has {world} ranks; resolve the plan with "
            f"tp_size={world} (the size of the tensor-parallel group)."
        )
    needs_rng = plan.rng_regions or any(e.style in ("dropout", "attention") for e in plan.entries)
    if needs_rng and rng_tracker is None:
        raise MegatronConfigError(
            "rng_tracker=None: the plan has dropout on tensor-parallel activations (attention dropout of local "
            "heads or dropout between column and row layers), which needs a ModelParallelRNGTracker; pass "
            "rng_tracker=ModelParallelRNGTracker(tp_rank=..., device=...)."
        )

    modules = dict(module.named_modules())
    # every (parent, attribute) that holds each module object, so shared modules are all replaced
    sites: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for parent in {id(m): m for m in module.modules()}.values():
        for attr, child in parent._modules.items():
            if child is not None:
                sites[id(child)].append((parent, attr))

    sharded = plan.sharded
    for e in sharded:
        m = modules.get(e.name)
        if m is None or _type_name(m) != e.module_type:
            found = "no such module" if m is None else f"a {_type_name(m)}"
            raise MegatronConfigError(
                f"plan entry {e.name!r} ({e.style}) expects a {e.module_type} but the module has {found}; "
                "resolve the plan on this module right before applying it (was it applied twice?)."
            )
    # ties, by Parameter identity, before anything is replaced
    for e in sharded:
        tied = e.extra.get("tied_to")
        if tied is not None and modules[e.name].weight is not modules[tied].weight:
            raise MegatronConfigError(
                f"plan says {e.name}.weight is tied to {tied}.weight but they are different Parameters now; "
                "resolve the plan again."
            )
        for attr in e.extra.get("bias_aliases", ()):
            holder = modules[parent_name(e.name)] if parent_name(e.name) else module
            if getattr(holder, attr, None) is not modules[e.name].bias:
                raise MegatronConfigError(
                    f"plan says {join_name(parent_name(e.name), attr)} aliases {e.name}.bias but it no longer does; "
                    "resolve the plan again."
                )
    for f in plan.fixups:
        owner = modules[f.module] if f.module else module
        if getattr(owner, f.attr, None) != f.old:
            raise MegatronConfigError(
                f"plan fix-up {join_name(f.module, f.attr)}: expected {f.old!r}, found {getattr(owner, f.attr, None)!r}; "
                "resolve the plan on this module right before applying it (was it applied twice?)."
            )

    input_copies: dict[str, Any] = {}

    def copy_for(e: PlanEntry):
        key = e.extra.get("input_copy")
        if key is None:
            return None
        if key not in input_copies:
            input_copies[key] = SharedInputCopy(group)
        return input_copies[key]

    def as_linear(m: nn.Module) -> nn.Linear:
        """A Conv1D's weight as a (meta-built) nn.Linear view ``[out, in]``; nn.Linear as is."""
        if not is_conv1d(m):
            return m
        fin, fout = _features(m)
        lin = nn.Linear(fin, fout, bias=m.bias is not None, device="meta")
        lin.weight = nn.Parameter(m.weight.detach().t(), requires_grad=m.weight.requires_grad)
        if m.bias is not None:
            lin.bias = m.bias
        return lin

    replaced: dict[str, nn.Module] = {}

    def build(e: PlanEntry) -> nn.Module:
        m = modules[e.name]
        if e.style == "column":
            kw = dict(group=group, packed_chunks=int(e.extra.get("packed_chunks", 1)), input_copy=copy_for(e))
            if is_conv1d(m):
                # a transposed view (not detached): from_weight copies it and keeps requires_grad
                return ColumnParallelLinear.from_weight(m.weight.t(), m.bias, **kw)
            return ColumnParallelLinear.from_linear(m, **kw)
        if e.style == "row":
            if is_conv1d(m):
                return RowParallelLinear.from_weight(m.weight.t(), m.bias, group=group)
            return RowParallelLinear.from_linear(m, group=group)
        if e.style == "vocab":
            if isinstance(m, nn.Embedding):
                return VocabParallelEmbedding.from_embedding(m, group=group)
            from megastrategy.layers.vocab_head import VocabParallelHead

            tied = e.extra.get("tied_to")
            return VocabParallelHead.from_linear(
                as_linear(m), group=group, tied_embedding=replaced[tied] if tied else None
            )
        if e.style == "attention":
            from megastrategy.layers.attention import TensorParallelMultiheadAttention

            return TensorParallelMultiheadAttention.from_module(m, group=group, rng_tracker=rng_tracker)
        if e.style == "dropout":
            from megastrategy.layers.random import TensorParallelRegionDropout

            return TensorParallelRegionDropout.from_dropout(m, rng_tracker)
        raise AssertionError(e.style)

    def rank(e: PlanEntry) -> int:
        if e.style == "vocab":
            return 0 if e.extra.get("vocab_layer") == "embedding" else 2
        return 1

    for e in sorted(sharded, key=rank):
        old = modules[e.name]
        new = build(e)
        new.train(old.training)
        for parent, attr in sites[id(old)]:
            setattr(parent, attr, new)
        replaced[e.name] = new
        for attr in e.extra.get("bias_aliases", ()):
            holder = modules[parent_name(e.name)] if parent_name(e.name) else module
            setattr(holder, attr, new.bias)

    for f in plan.fixups:
        setattr(modules[f.module] if f.module else module, f.attr, f.new)

    for region in plan.rng_regions:
        owner = modules[region.module] if region.module else module
        hooks = _RNGRegionHooks(rng_tracker, region.dropout_p)
        owner.register_forward_pre_hook(hooks.enter)
        owner.register_forward_hook(hooks.leave, always_call=True)
        if region.until is not None:
            until = replaced.get(region.until) or modules[region.until]
            until.register_forward_pre_hook(hooks.leave_early)

