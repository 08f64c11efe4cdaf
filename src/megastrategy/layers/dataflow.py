"""Which layer's output reaches which layer's input: the data flow of one forward, recorded.

Structural plan detection (:mod:`megastrategy.layers.structural_plans`) must know that a
projection's output feeds the attention's output projection, not guess it from names. So the
model runs once (eval, no grad, random ids, a private RNG) under a ``TorchFunctionMode`` that
tags every tensor with the set of watched modules it was computed from: a cutting module's
(a linear layer's) output is tagged with that module alone; any other op's result carries the union of its
inputs' tags. A watched module's input tags then name the nearest watched layers upstream.

Also recorded: the first op that consumes each watched module's output (how the forward cuts
a packed QKV projection: a ``view`` into heads, a ``split`` into equal chunks, ...; an ``unsqueeze``
first is seen through, as GPT-BigCode's ``c_attn(x).unsqueeze(1).split(...)``), and the
identity of each watched module's input tensor (layers fed the very same tensor).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["FirstUse", "DataFlow", "trace_dataflow", "run_under"]

#: a boolean read of a meta tensor (``megastrategy plan`` builds models on the meta device) has no
#: value; the mask code asks "is every token unpadded?", which for random ids without padding is
#: True. Any other data-dependent read on meta still raises (and nothing is detected)
_READS = (torch.Tensor.item, torch.Tensor.__bool__)
#: ops that only add a unit dimension: the first use recorded is the op applied after them
_SEEN_THROUGH = ("unsqueeze",)


@dataclass(frozen=True)
class FirstUse:
    """The first op applied to a module's output: its name, the output's shape, and the shapes
    of the op's tensor results."""

    op: str
    shape: tuple[int, ...]
    results: tuple[tuple[int, ...], ...]


@dataclass
class DataFlow:
    """``sources[m]``: watched modules upstream of ``m``'s input; ``input_id[m]``: identity of the
    tensor ``m`` first received; ``first_use[m]``: how ``m``'s output is first consumed."""

    sources: dict[str, frozenset[str]] = field(default_factory=dict)
    input_id: dict[str, int] = field(default_factory=dict)
    first_use: dict[str, FirstUse] = field(default_factory=dict)


class _TagMode(TorchFunctionMode):
    """Propagates tags through every torch function call; records first uses."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # keeps tagged tensors alive, so ids stay unique
        self.outputs: dict[int, str] = {}  # id of a watched module's output -> module name
        self.flow = DataFlow()

    def tag_of(self, tree: Any) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                found |= self.tags.get(id(leaf), frozenset())
        return found

    def set_tag(self, tree: Any, tag: frozenset[str]) -> None:
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self.tags[id(leaf)] = tag
                self.alive.append(leaf)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS and args and args[0].is_meta and args[0].dtype == torch.bool:
            return True  # see _READS
        result = func(*args, **kwargs)
        tag = self.tag_of((args, kwargs))
        if tag:
            self.set_tag(result, tag)
        self._record_first_use(func, args, result)
        return result

    def _record_first_use(self, func, args, result) -> None:
        for leaf in tree_leaves(args):
            name = self.outputs.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if name is not None and name not in self.flow.first_use:
                shapes = tuple(tuple(t.shape) for t in tree_leaves(result) if isinstance(t, torch.Tensor))
                if not shapes:  # .shape, .size(), .dim(): reading metadata is no use
                    continue
                op = getattr(func, "__name__", str(func))
                if op in _SEEN_THROUGH and isinstance(result, torch.Tensor):
                    self.outputs.setdefault(id(result), name)  # (the tag keeps ``result`` alive)
                    continue
                self.flow.first_use[name] = FirstUse(op, tuple(leaf.shape), shapes)


def _watch(mode: _TagMode, name: str, module: nn.Module, cuts: bool) -> list[Any]:
    def before(mod, args):
        first = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
        mode.flow.sources.setdefault(name, mode.tag_of(args))
        if first is not None:
            mode.flow.input_id.setdefault(name, id(first))

    def after(mod, args, output):
        if not cuts:
            return
        mode.set_tag(output, frozenset((name,)))
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor):
                mode.outputs.setdefault(id(leaf), name)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def trace_dataflow(root: nn.Module, watched: dict[str, nn.Module], cuts: set[str], run) -> DataFlow | None:
    """Run ``run()`` (one forward of ``root``) with ``watched`` (name -> module) instrumented;
    the outputs of the modules named in ``cuts`` start new tags, the others pass tags through.
    ``None`` if the forward raised (the model needs other inputs). Training flags are restored."""
    mode = _TagMode()
    handles = [h for name, m in watched.items() for h in _watch(mode, name, m, name in cuts)]
    return mode.flow if run_under(root, mode, handles, run) else None  # raised: nothing detected


def run_under(root: nn.Module, mode: TorchFunctionMode, handles: list, run) -> bool:
    """Run ``run()`` (a forward of ``root``) in eval mode, without grad, under ``mode``; False if it
    raised. The hooks in ``handles`` are removed and the training flags restored afterwards."""
    flags = {m: m.training for m in root.modules()}
    root.eval()
    try:
        with torch.no_grad(), mode:
            run()
        return True
    except Exception:  # noqa: BLE001 - the caller learns nothing from this forward
        return False
    finally:
        for h in handles:
            h.remove()
        for m, training in flags.items():
            m.training = training
