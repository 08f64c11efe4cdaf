"""``megastrategy plan``: what tensor parallelism would do to a model, without running it.

For an import path (``pkg.module:Class``, built with no arguments) or a Hugging Face model type
(``llama``, ``roberta``: built from its default config on the ``meta`` device, so even a 70B
config costs no memory) and a ``tp``, print every sharded module, its style, where the style
came from (declared by transformers / built-in / the user's ``tp_plan`` glob), what stays
replicated, and the parameters each rank holds. Resolution is the strategy's own (pure).
"""
from __future__ import annotations

import importlib
import json
from collections import Counter
from typing import Any

import torch
from torch import nn

from megastrategy.fused_experts import is_fused_experts, is_routed_experts
from megastrategy.layers.plan import ResolvedPlan, resolve_tp_plan
from megastrategy.layers.plan.module_names import globify
from megastrategy.layers.shard_spec import padded_size_for

__all__ = ["load_model", "describe_source", "parameters_per_rank", "plan_report", "report_for"]

_TASKS = {
    "lm": "AutoModelForCausalLM",
    "mlm": "AutoModelForMaskedLM",
    "cls": "AutoModelForSequenceClassification",
    "s2s": "AutoModelForSeq2SeqLM",
}


def load_model(target: str, task: str = "lm") -> nn.Module:
    """``pkg.module:Class`` (no-argument constructor) or a Hugging Face model type (meta device)."""
    if ":" in target:
        mod, _, attr = target.partition(":")
        return getattr(importlib.import_module(mod), attr)()
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(target)
    with torch.device("meta"):
        return getattr(transformers, _TASKS[task]).from_config(config)


def describe_source(source: str) -> str:
    if source.startswith("declared:"):
        return f"declared by transformers ({source.split(':', 1)[1]})"
    if source.startswith("structural:"):
        return f"structural ({source.split(':', 1)[1]}: traced data flow)"
    if source.startswith("auto:"):
        return f"built-in ({source.split(':', 1)[1]})"
    if source.startswith("tp_plan["):
        return f"user glob {source[len('tp_plan'):]}"
    return "not named in tp_plan"


def _local_numel(module: nn.Module, style: str, attr: str, tp: int) -> int:
    """Elements one rank holds of ``module.<attr>`` (vocab rows padded to a multiple of tp)."""
    p = getattr(module, attr)
    if style == "vocab":
        rows = p.shape[0]
        return padded_size_for(rows, tp) // tp * (p.numel() // rows)
    if style == "row" and attr == "bias":
        return p.numel()  # added after the reduction: whole on every rank
    return p.numel() // tp


def parameters_per_rank(module: nn.Module, plan: ResolvedPlan) -> tuple[int, int]:
    """``(per rank, total)``: each Parameter counted once (a tied head's weight with its embedding)."""
    total = sum(p.numel() for p in module.parameters())
    saved = 0
    seen: set[int] = set()
    for e in plan.sharded:
        m = module.get_submodule(e.name)
        for attr in ("weight", "bias"):
            p = getattr(m, attr, None)
            if not isinstance(p, nn.Parameter) or id(p) in seen:
                continue
            seen.add(id(p))
            if e.style in ("column", "row", "vocab"):
                saved += p.numel() - _local_numel(m, e.style, attr, plan.tp_size)
    return total - saved, total


def _replicated_names(plan: ResolvedPlan) -> list[str]:
    """Replicated layers: one glob where every repeat is replicated, else the exact names."""
    every = Counter(globify(e.name) for e in plan.entries)
    replicated = [e.name for e in plan.entries if e.style == "replicate"]
    counts = Counter(globify(n) for n in replicated)
    out: list[str] = []
    for name in replicated:
        glob = globify(name)
        shown = glob if counts[glob] == every[glob] else name
        if shown not in out:
            out.append(shown)
    return out


def _experts_lines(module: nn.Module, ep: int) -> tuple[list[str], int]:
    """Hugging Face fused experts (whole under TP, split over ``ep``): the report's line, and the
    elements a rank does not hold because of ``ep``."""
    experts = [(n, m) for n, m in module.named_modules() if is_fused_experts(m) or is_routed_experts(m)]
    if not experts:
        return [], 0
    numel = sum(p.numel() for _, m in experts for p in m.parameters())
    names = sorted({globify(n) for n, _ in experts})
    how = f"split over ep={ep} by expert parallelism" if ep > 1 else "pass ep > 1 to split them over experts"
    return [f"experts (whole on every TP rank; {how}): " + ", ".join(names)], numel - numel // ep


def plan_report(module: nn.Module, plan: ResolvedPlan, ep: int = 1) -> str:
    """The plan as text: sharded modules (one line per glob), replicated layers, parameters per rank."""
    groups: dict[tuple[str, str, str], int] = Counter()
    for e in plan.sharded:
        shown = ("packed_chunks", "packed_sections", "gather_output", "split_input", "q_heads", "kv_heads", "head_dim", "interleaved", "kv_replicas")
        extra = ", ".join(f"{k}={v}" for k, v in e.extra.items() if k in shown)
        groups[(globify(e.name), e.style + (f" ({extra})" if extra else ""), describe_source(e.source))] += 1
    rows = [("module", "style", "source", "count")] + [(*k, str(n)) for k, n in groups.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{type(module).__name__}: tp={plan.tp_size}, {len(plan.sharded)} module(s) sharded"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    replicated = _replicated_names(plan)
    if replicated:
        lines.append("replicated (whole on every rank): " + ", ".join(replicated))
    expert_lines, not_held = _experts_lines(module, ep)
    lines += expert_lines
    local, total = parameters_per_rank(module, plan)
    local -= not_held
    lines.append(f"parameters per rank: {local:,} of {total:,} ({100 * local / max(total, 1):.1f}%)")
    if any(not e.source.startswith("tp_plan[") for e in plan.sharded):
        lines.append(_CHECKED_AT_SETUP)
    return "\n".join(lines)


# the report reads the plan on one process; the block check needs the tensor-parallel ranks
_CHECKED_AT_SETUP = (
    "note: this is the plan before the block check. At setup each auto-detected block is sharded on a copy and "
    "run on its ranks; a block whose copy does not compute what the original does is kept whole (one warning "
    "names it and its share of the parameters). `megastrategy check` runs the layout and prints that warning.")


def report_for(target: str, tp: int, task: str = "lm", tp_plan: Any = None, ep: int = 1) -> str:
    """Load ``target``, resolve its plan at ``tp`` (``tp_plan``: a dict or its JSON) and describe it."""
    if isinstance(tp_plan, str):
        tp_plan = json.loads(tp_plan)
    module = load_model(target, task)
    return plan_report(module, resolve_tp_plan(module, tp_plan, tp), ep=ep)
