"""The token embedding and output head of a user's own transformer, vocab-parallel only where that
is exact (:mod:`megastrategy.layers.user_stack_plans`).

A vocab-parallel embedding looks tokens up exactly, and a vocab-parallel head returns logits that
run ``F.cross_entropy`` vocab-parallel and gather for anything else
(:mod:`megastrategy.layers.vocab_parallel_logits`), so the user's loss code is safe whatever it
does. What is not safe is a forward that reads the weight *outside* the layer: nanoGPT-style
tying done functionally (``x @ self.wte.weight.T``), a scaled lookup through ``F.embedding``, a
norm of the weight. The guessed forward therefore runs once more while every torch function
call is watched: a layer's weight used by anything but the layer's own call leaves both layers
replicated. So does an ambiguous pair (two embeddings as large as the head's output), a head
tied to anything but the embedding, an embedding sharing its weight with another embedding, or a
subclass with its own ``forward``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from megastrategy.layers.dataflow import run_under
from megastrategy.layers.unit_types import BuiltinUnit
from megastrategy.naming import join_name

__all__ = ["vocab_units"]


def _outside_blocks(root: nn.Module, kind: type) -> list[tuple[str, nn.Module]]:
    """Modules of exactly type ``kind`` that are not inside a repeated block (no digit in the path)."""
    return [(n, m) for n, m in root.named_modules()
            if type(m) is kind and n and not any(part.isdigit() for part in n.split("."))]


def _pair(root: nn.Module) -> Optional[tuple[str, nn.Embedding, tuple[str, nn.Linear]]]:
    """The token embedding and the one head whose output is its vocabulary, holding their weights
    alone (or tied to each other); None if there is no such unambiguous pair."""
    embeddings = _outside_blocks(root, nn.Embedding)
    heads = [(n, m) for n, m in _outside_blocks(root, nn.Linear) if any(m.out_features == e.num_embeddings for _, e in embeddings)]
    if len(heads) != 1:
        return None
    head_name, head = heads[0]
    matching = [(n, e) for n, e in embeddings if e.num_embeddings == head.out_features]
    if len(matching) != 1:
        return None
    name, emb = matching[0]
    own = (name + ".", head_name + ".")
    for weight in (emb.weight, head.weight):  # held by nothing but these two layers
        if any(p is weight and not n.startswith(own) for n, p in root.named_parameters(remove_duplicate=False)):
            return None
    return name, emb, (head_name, head)


class _WeightUses(TorchFunctionMode):
    """Records whether the watched weights are used by a call outside their own layers."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.owners: dict[int, list[nn.Module]] = {}
        for m in layers:  # a tied weight has two owners
            self.owners.setdefault(id(m.weight), []).append(m)
        self.inside: list[nn.Module] = []
        self.stray = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            owners = self.owners.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if owners is not None and not (self.inside and any(self.inside[-1] is o for o in owners)):
                self.stray = True
        return func(*args, **kwargs)


def _weights_stay_inside(root: nn.Module, layers: list[nn.Module], run: Callable[[], Any]) -> bool:
    """``run()`` raises nothing and reads the layers' weights only in the layers' own calls."""
    mode = _WeightUses(layers)
    handles = []

    def enter(mod, args) -> None:
        mode.inside.append(mod)

    def leave(mod, args, output) -> None:  # returns None: a forward hook's value would replace the output
        mode.inside.pop()

    for m in layers:
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    return run_under(root, mode, handles, run) and not mode.stray  # raised now: do not shard the vocabulary


def vocab_units(root_name: str, root: nn.Module, arch: str, covered: set[str], run: Callable[[], Any]) -> list[BuiltinUnit]:
    """``vocab`` units for the embedding (and head) of ``root`` when sharding them is exact; else none."""
    found = _pair(root)
    if found is None:
        return []
    name, emb, (head_name, head) = found
    if {join_name(root_name, name), join_name(root_name, head_name)} & covered:
        return []
    if not _weights_stay_inside(root, [emb, head], run):
        return []
    return [BuiltinUnit(arch, "embedding", root_name, [(join_name(root_name, name), "vocab", {})], origin="structural"),
            BuiltinUnit(arch, "lm_head", root_name, [(join_name(root_name, head_name), "vocab", {})], origin="structural")]
