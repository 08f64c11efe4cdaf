"""The user's ``tp_plan`` as rules: accepted styles, parsing, and glob specificity (the
precedence rule of :mod:`megastrategy.layers.plan`)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from megastrategy.errors import MegatronConfigError

__all__ = ["STYLES", "AUTO", "BUILTIN_ONLY_STYLES", "SHARDED_STYLES", "Rule", "glob_specificity", "parse_tp_plan"]

STYLES = ("column", "row", "vocab", "replicate")
#: accepted as a ``tp_plan`` value besides :data:`STYLES`
AUTO = "auto"
#: styles of resolved entries that only auto-detection produces
BUILTIN_ONLY_STYLES = ("attention", "dropout")
#: styles whose layers are replaced by sharded ones (their parameters must not be shared)
SHARDED_STYLES = ("column", "row", "vocab", "attention")
#: Hugging Face / other libraries' style names, suggested in the error for an unknown style
HF_STYLE_NAMES = {
    "colwise": "column",
    "col": "column",
    "columnwise": "column",
    "rowwise": "row",
    "embedding": "vocab",
    "replicated": "replicate",
    "none": "replicate",
}


@dataclass
class Rule:
    """One ``tp_plan`` entry and the module names its glob matches."""

    glob: str
    style: str
    spec: tuple[int, int]
    matches: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        return f"tp_plan[{self.glob!r}]"


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


def parse_tp_plan(tp_plan: Any) -> list[Rule]:
    """The user's ``tp_plan`` as rules; unknown styles and malformed keys are errors here."""
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
            suggestion = HF_STYLE_NAMES.get(str(style).lower()) if isinstance(style, str) else None
            if suggestion is None and isinstance(style, str):
                close = difflib.get_close_matches(style.lower(), allowed, n=1, cutoff=0.5)
                suggestion = close[0] if close else None
            hint = f"; did you mean {suggestion!r}?" if suggestion else ""
            raise MegatronConfigError(
                f"tp_plan[{glob!r}]={style!r} is not a tensor-parallel style; use one of "
                f"{', '.join(repr(s) for s in allowed)}{hint}"
            )
        rules.append(Rule(glob, style, glob_specificity(glob)))
    return rules
