"""Keep an auto-detected block whole, instead of refusing to train, when its sharded copy does not
compute what the original does.

nanoGPT's attention reads ``C`` from ``x.size()`` and splits ``c_attn``'s output by
``self.n_embd``: on its local heads the forward raises, so structural detection's reading
(``c_attn`` column, ``c_proj`` row) cannot run, although the MLP next to it shards fine.
Refusing the whole model for that would leave a user who asked for ``tp=2`` with nothing; the
exact alternative is to run that attention unchanged (replicated) and shard the rest.

The decision comes *before* the real model is sharded: each representative block's unsharded
copy (``CapturedBlock.reference``) is copied again and sharded with the plan restricted to it
(:func:`megastrategy.layers.plan.restrict.restrict_to_block`), then checked on its captured input
(:mod:`megastrategy.layers.block_check`; every rank, with the same collectives). Blocks that fail
and whose entries all come from auto-detection (built-in, declared by Hugging Face, structural)
are dropped from the plan with every block of the same signature (class and plan), and ONE
rank-zero warning names them, the check's detail, the share of parameters left unsharded and the
change that would shard them. A failing block with an entry the user named in ``tp_plan`` is not
second-guessed: it stays in the plan and the post-sharding check refuses, as before.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import replace

import torch
from torch import nn

from megastrategy.layers.block_capture import CapturedBlock, _signature, sharded_blocks
from megastrategy.layers.block_check import block_mismatch
from megastrategy.layers.mappings import all_reduce
from megastrategy.layers.plan import apply_tp_plan
from megastrategy.layers.plan.module_names import globify
from megastrategy.layers.plan.resolved import ResolvedPlan
from megastrategy.layers.plan.restrict import is_within, restrict_to_block, without_blocks
from megastrategy.rank_zero import log_on_rank_zero

__all__ = ["keep_failing_blocks_whole", "blocks_to_keep_whole", "trial_failures"]

_log = logging.getLogger(__name__)


def _trial(cap: CapturedBlock, plan: ResolvedPlan, group, rng_tracker) -> str | None:
    """What differs when a fresh copy of ``cap``'s block is sharded with its part of ``plan``."""
    holder = nn.Module()  # the block as a child, so that entries naming the block itself apply too
    holder.add_module("block", copy.deepcopy(cap.reference))
    try:
        apply_tp_plan(holder, restrict_to_block(plan, cap.name, "block"), group=group, rng_tracker=rng_tracker)
    except Exception as exc:  # noqa: BLE001 - the same on every rank; the real apply would fail too
        first = (str(exc).strip().splitlines() or ["(no message)"])[0]
        return f"sharding it raised {type(exc).__name__}: {first}"
    return block_mismatch(holder, replace(cap, name="block"), group)


def trial_failures(captured: list[CapturedBlock], plan: ResolvedPlan, group, rng_tracker) -> dict[str, str]:
    """Representative block -> why its sharded copy differs (on any rank); every rank returns the same."""
    failures = {}
    for cap in captured:
        detail = _trial(cap, plan, group, rng_tracker)
        device = next(cap.reference.parameters()).device
        flag = all_reduce(torch.tensor([1.0 if detail else 0.0], device=device), group, op="max")
        if flag.item() > 0:
            failures[cap.name] = detail or "a mismatch on another tensor-parallel rank"
    return failures


def _user_named(plan: ResolvedPlan, block: str) -> bool:
    return any(is_within(e.name, block) and e.source.startswith("tp_plan[") for e in plan.entries)


def blocks_to_keep_whole(module: nn.Module, plan: ResolvedPlan, failures: dict[str, str]) -> dict[str, str]:
    """Every block to keep whole -> the failing representative's detail: the auto-detected failing
    representatives and the blocks of the same signature. Pure."""
    blocks = sharded_blocks(plan)
    chosen = {name: failures[name] for name in failures if name in blocks and not _user_named(plan, name)}
    sigs = {_signature(module, name, blocks[name]): detail for name, detail in chosen.items()}
    keep = {}
    for name, entries in blocks.items():
        detail = sigs.get(_signature(module, name, entries))
        if detail is not None:
            keep[name] = detail
    return keep


def _share(module: nn.Module, blocks: list[str]) -> float:
    params = {id(p): p.numel() for p in module.parameters()}
    kept = {id(p): p.numel() for b in blocks for p in (module.get_submodule(b) if b else module).parameters()}
    return sum(kept.values()) / max(sum(params.values()), 1)


def fallback_warning(module: nn.Module, keep: dict[str, str], tp: int) -> str:
    """The one warning: which blocks, why, what share of the parameters, and the fix."""
    globs = list(dict.fromkeys(globify(n) for n in keep))
    reasons = "; ".join(f"{g}: {d}" for g, d in {globify(n): d for n, d in keep.items()}.items())
    return (
        f"megastrategy: tp={tp}: keeping {len(keep)} auto-detected block(s) whole (replicated, not sharded): "
        f"{', '.join(repr(g) for g in globs)}, because the sharded block does not compute what the original "
        f"computes ({reasons}). They hold {_share(module, list(keep)):.1%} of the model's parameters, which "
        f"every tensor-parallel rank keeps in full; training is exact. {_fix(keep)}; "
        f"tp_plan={{'*': 'auto', {globs[0]!r}: 'replicate'}} keeps them whole without this warning."
    )


def _fix(keep: dict[str, str]) -> str:
    """What would shard them: sizes read from the tensor when the forward raised, else a plan."""
    if any("raised" in d for d in keep.values()):
        return ("To shard them, make the forward read its sizes from the tensor rather than the full sizes "
                "(nanoGPT: split(x.shape[-1] // 3, dim=2), view(B, T, self.n_head, -1), y.view(B, T, -1)), "
                "or name their layers in tp_plan")
    return "To shard them, name their layers in tp_plan with the styles their forward needs"


def keep_failing_blocks_whole(
    module: nn.Module, plan: ResolvedPlan, captured: list[CapturedBlock], group, tp: int, rng_tracker
) -> tuple[ResolvedPlan, list[CapturedBlock]]:
    """The plan to apply (failing auto-detected blocks left out) and the captured blocks still to
    verify after sharding; warns once on rank zero when a block is kept whole."""
    failures = trial_failures(captured, plan, group, rng_tracker)
    keep = blocks_to_keep_whole(module, plan, failures) if failures else {}
    if not keep:
        return plan, captured
    log_on_rank_zero(_log, logging.WARNING, fallback_warning(module, keep, tp))
    return without_blocks(plan, keep), [c for c in captured if c.name not in keep]
