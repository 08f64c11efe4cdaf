"""Before sharding: which blocks to verify, and the inputs each receives on a random batch.

A *block* is the smallest module holding both ends of a tensor-parallel region (the column
layers and the row layer consuming their output), so that its output is replicated again and
can be compared with the unsharded original. One block per distinct (class, plan) is enough:
every repeat of a layer runs the same code on the same plan.

Inputs come from one forward of the enclosing Hugging Face model on random token ids (eval
mode, no grad, a private RNG: the user's random streams are untouched). Blocks outside a
Hugging Face model (a user's own modules under ``tp_plan``, LitGPT, ``torch.nn`` layers) run
on a guessed random input (:mod:`megastrategy.layers.plain_block_inputs`); those no guess
reaches are not captured.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megastrategy.layers.plain_block_inputs import capture_plain_inputs
from megastrategy.layers.plan.module_names import globify
from megastrategy.layers.random_ids_forward import SEED, forward_on_random_ids
from megastrategy.layers.plan.resolved import PlanEntry, ResolvedPlan
from megastrategy.layers.unit_types import is_hf_pretrained
from megastrategy.naming import parent_name
from megastrategy.rank_zero import log_on_rank_zero

__all__ = ["SEED", "CapturedBlock", "sharded_blocks", "capture_blocks"]

#: entry styles that live inside a block (vocab layers are the project's own exact layers)
_BLOCK_STYLES = ("column", "row", "grad_sum", "dropout", "attention", "head_table", "head_vector", "multi_query", "kv_whole")
_log = logging.getLogger(__name__)
#: key/value caches: a block must not see (or extend) the capture run's cache
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache_params")


@dataclass
class CapturedBlock:
    name: str
    reference: nn.Module  # a deep copy of the unsharded block
    args: tuple
    kwargs: dict
    sources: tuple[str, ...]  # where its plan entries came from
    entries: tuple[str, ...] = ()  # its plan entries, "<name in the block>: <style>"


def _opens(e: PlanEntry) -> bool:
    return e.style == "multi_query" or e.style == "column" and not e.extra.get("gather_output")


def _closes(e: PlanEntry) -> bool:
    return e.style == "row" and not e.extra.get("split_input")


def sharded_blocks(plan: ResolvedPlan) -> dict[str, list[PlanEntry]]:
    """Block name -> its entries: entries grouped by parent, each group moved up until it
    holds both the column layers opening a TP region and the row layer closing it."""
    groups: dict[str, list[PlanEntry]] = {}
    for e in plan.entries:
        if e.style in _BLOCK_STYLES:
            groups.setdefault(parent_name(e.name), []).append(e)
    while True:
        unbalanced = [k for k, es in groups.items() if k and any(map(_opens, es)) != any(map(_closes, es))]
        if not unbalanced:
            return groups
        for key in unbalanced:
            groups.setdefault(parent_name(key), []).extend(groups.pop(key))


def _glob_extra(e: PlanEntry) -> list[tuple[str, str]]:
    """``extra`` with module names globbed (``input_copy='blocks.1'`` is the same as ``'blocks.0'``)."""
    return [(k, globify(v) if isinstance(v, str) else repr(v)) for k, v in e.extra.items()]


def _signature(module: nn.Module, name: str, entries: list[PlanEntry]) -> tuple:
    rel = tuple(sorted((globify(e.name), e.style, str(sorted(_glob_extra(e)))) for e in entries))
    return (type(module.get_submodule(name) if name else module).__qualname__, rel)


def _representatives(module: nn.Module, blocks: dict[str, list[PlanEntry]]) -> dict[str, list[PlanEntry]]:
    seen: set[tuple] = set()
    chosen = {}
    for name, entries in blocks.items():
        sig = _signature(module, name, entries)
        if sig not in seen:
            seen.add(sig)
            chosen[name] = entries
    return chosen


def _hf_root(module: nn.Module, name: str) -> tuple[str, nn.Module] | None:
    for n, m in module.named_modules():
        if is_hf_pretrained(m) and (n == "" or name.startswith(n + ".")):
            return n, m
    return None


def _is_cache(value: Any) -> bool:
    """A key/value cache object under any argument name (Flaubert/XLM pass ``cache=``): a class of
    transformers' ``Cache`` family, or anything with their ``update``/``get_seq_length`` methods.
    Replaying a block with the capture run's cache would attend over the cached keys too (each call
    appends to it), so the reference and the sharded call would see different key lengths."""
    if isinstance(value, (torch.Tensor, nn.Module)):
        return False
    named = any(c.__name__.endswith("Cache") for c in type(value).__mro__[:-1])
    return named or (callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None)))


def _detached(tree: Any) -> Any:
    if _is_cache(tree):
        return None
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_detached(t) for t in tree)
    if isinstance(tree, list):
        return [_detached(t) for t in tree]
    if isinstance(tree, dict):
        return {k: None if k in _CACHE_KWARGS else _detached(v) for k, v in tree.items()}
    return tree


def _run_hf_model(root: nn.Module, targets: dict[str, nn.Module]) -> dict[str, tuple[tuple, dict]]:
    """One eval forward of ``root`` on random ids; the first (args, kwargs) each target receives."""
    captured: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for name, block in targets.items():
        def grab(mod, args, kwargs, name=name):
            captured.setdefault(name, (_detached(args), _detached(kwargs)))
        handles.append(block.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        forward_on_random_ids(root)
    except Exception as exc:  # noqa: BLE001 - a model needing other inputs: its blocks stay unverified
        log_on_rank_zero(_log, logging.WARNING, (
            f"megastrategy: the sharded blocks {', '.join(sorted(targets))} are not verified against their "
            f"unsharded originals: {type(root).__name__}(input_ids=...) raised {type(exc).__name__}: {exc}"))
    finally:
        for h in handles:
            h.remove()
    return captured


def _relative_entries(name: str, entries: list[PlanEntry]) -> tuple[str, ...]:
    return tuple(f"{e.name[len(name) + 1:] if name else e.name}: {e.style}" for e in entries)


def capture_blocks(module: nn.Module, plan: ResolvedPlan) -> list[CapturedBlock]:
    """The representative blocks of ``plan`` with their inputs and unsharded copies; the
    module's training flags are restored afterwards."""
    chosen = _representatives(module, sharded_blocks(plan))
    by_root: dict[str, dict[str, nn.Module]] = {}
    plain = {}
    for name in chosen:
        root = _hf_root(module, name)
        if root is not None:
            by_root.setdefault(root[0], {})[name] = module.get_submodule(name)
        else:
            plain[name] = chosen[name]
    flags = {m: m.training for m in module.modules()}
    module.eval()
    try:
        captured: dict[str, tuple[tuple, dict]] = {}
        for root_name, targets in by_root.items():
            captured.update(_run_hf_model(module.get_submodule(root_name) if root_name else module, targets))
        captured.update(capture_plain_inputs(module, plain, _detached))
    finally:
        for m, mode in flags.items():
            m.training = mode
    return [
        CapturedBlock(name, copy.deepcopy(module.get_submodule(name)), args, kwargs,
                      tuple(dict.fromkeys(e.source for e in chosen[name])), _relative_entries(name, chosen[name]))
        for name, (args, kwargs) in captured.items()
    ]
