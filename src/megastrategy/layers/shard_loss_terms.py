"""Refuse a training loss that reads tensor-parallel shards outside their layers' forward.

Under tensor parallelism a sharded layer's forward combines its rank's shard with the others' (the
row layer's all-reduce, the vocab-parallel cross-entropy), so what it returns is one device's. Code
of the step that reads the shard itself does not: ``loss + λ·Σ‖p‖²`` over ``self.parameters()``
(weight decay by hand) sums 1/tp of each sharded weight. Its gradient is still each shard's part of
one device's (the weights trained are DDP's), but the loss value, what is logged and what
``ModelCheckpoint``/``EarlyStopping`` monitor, is not (142 against one device's 229 at tp2, silently).
A strategy cannot all-reduce a sum inside the user's step, so it is refused by name, at the first
training step of each fit, before its backward.

How: during that step every module that holds a sharded parameter records the span of autograd
sequence numbers its forward creates; the loss's graph is then walked, and a sharded parameter that
feeds a node created outside every such span was read by the step's own code. Pipeline parallelism
refuses the same habit on its own (:mod:`megastrategy.pipeline.local_loss_terms`), so this runs at
``pp=1``.
"""
from __future__ import annotations

import bisect
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from megastrategy.component import Component, SetupContext, StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.shard_spec import get_shard_spec

__all__ = ["ShardLossTerms", "LayerCallSpans", "shards_read_outside_layers"]

_PROBE = torch.zeros((), requires_grad=True)


def _next_sequence_nr() -> int:
    """The autograd sequence number the next node of this thread will get."""
    with torch.enable_grad():
        return _PROBE.view_as(_PROBE).grad_fn._sequence_nr() + 1


class LayerCallSpans:
    """``[start, end)`` sequence numbers of the nodes made inside the forward of a layer that holds a
    sharded parameter, or of one of the strategy's modules around such layers (its multi-head
    attention slices ``in_proj.weight`` itself), outermost calls only, while installed."""

    def __init__(self, module: nn.Module) -> None:
        self.spans: list[tuple[int, int]] = []
        self._depth, self._start = 0, 0
        self._handles = [h for m in _layers_reading_shards(module)
                         for h in (m.register_forward_pre_hook(self._enter),
                                   m.register_forward_hook(self._leave, always_call=True))]

    def _enter(self, *_: Any) -> None:
        if self._depth == 0:
            self._start = _next_sequence_nr()
        self._depth += 1

    def _leave(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.spans.append((self._start, _next_sequence_nr()))

    def inside(self, sequence_nr: int) -> bool:
        i = bisect.bisect_right(self.spans, (sequence_nr, float("inf"))) - 1
        return i >= 0 and self.spans[i][0] <= sequence_nr < self.spans[i][1]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _layers_reading_shards(module: nn.Module) -> list[nn.Module]:
    sharded = {id(p) for p in module.parameters() if get_shard_spec(p) is not None}
    owners = [m for m in module.modules() if any(id(p) in sharded for p in m.parameters(recurse=False))]
    ours = [m for m in module.modules() if type(m).__module__.startswith("megastrategy.")
            and any(id(p) in sharded for p in m.parameters())]
    return list({id(m): m for m in owners + ours}.values())


def shards_read_outside_layers(loss: Tensor, spans: LayerCallSpans) -> list[tuple[Tensor, str]]:
    """(parameter, the reading node's name) for each sharded parameter that ``loss``'s graph reads
    through a node made outside every layer call and that passes ``loss`` a nonzero gradient."""
    readers: list[tuple[Tensor, Any]] = []
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            param = getattr(child, "variable", None)
            if param is None:
                todo.append(child)
            elif get_shard_spec(param) is not None and not spans.inside(node._sequence_nr()):
                readers.append((param, node))
    found: dict[int, tuple[Tensor, str]] = {}
    for (param, node), counts in zip(readers, _gradient_reaches(loss, [node for _, node in readers])):
        if counts:
            found.setdefault(id(param), (param, type(node).__name__))
    return list(found.values())


def _gradient_reaches(loss: Tensor, nodes: list) -> list[bool]:
    """Per node: whether ``loss`` sends it a nonzero gradient. ``loss + 0 * sum(p.sum() ...)`` (DDP's
    old trick for unused parameters) reads every shard and changes nothing: its value is 0 on any layout."""
    if not nodes:
        return []
    edges = [[GradientEdge(n, i) for i in range(len(n._input_metadata))] for n in nodes]
    grads = iter(torch.autograd.grad(loss, [e for es in edges for e in es], retain_graph=True, allow_unused=True))
    return [any(g is not None and bool(g.any()) for g in [next(grads) for _ in es]) for es in edges]


class ShardLossTerms(Component):
    """``tp > 1``, ``pp = 1``: spans recorded during the first training step of a fit; the strategy
    hands the step's loss to :meth:`check` before its backward."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.tp > 1 and config.pp == 1
        self.tp = config.tp
        self._module: Optional[nn.Module] = None
        self._spans: Optional[LayerCallSpans] = None
        self._first = True

    def configure(self, ctx: SetupContext) -> None:
        self._module, self._first = ctx.module, True

    def begin_step(self, module: nn.Module, step: StepInfo) -> None:
        if step.training and self._first:
            self._spans = LayerCallSpans(module)

    def end_step(self, module: nn.Module, step: StepInfo) -> None:
        if self._spans is not None:
            self._spans.remove()
            self._spans, self._first = None, False

    def check(self, loss: Any) -> None:
        """Raise if ``loss`` (this step's, before its backward) reads a shard outside its layer."""
        if self._spans is None or not isinstance(loss, Tensor) or loss.grad_fn is None:
            return
        found = shards_read_outside_layers(loss, self._spans)
        if found:
            self.end_step(self._module, None)
            raise MegatronConfigError(self._refusal(found))

    def on_exception(self, exception: BaseException) -> None:
        self.teardown()

    def teardown(self) -> None:
        if self._spans is not None:
            self._spans.remove()
        self._spans = None

    def _refusal(self, found: list[tuple[Tensor, str]]) -> str:
        order = {id(p): (i, n) for i, (n, p) in enumerate(self._module.named_parameters())}
        names = {k: n for k, (_, n) in order.items()}
        found = sorted(found, key=lambda f: order.get(id(f[0]), (len(order), "")))
        listed = ", ".join(f"{names.get(id(p), '?')} (read by {node})" for p, node in found[:6])
        more = f" and {len(found) - 6} more" if len(found) > 6 else ""
        return (
            f"tp={self.tp}: training_step returned a loss that reads tensor-parallel shards outside their layers' "
            f"forward: {listed}{more}, e.g. a penalty summed over self.parameters() added to the loss. Each rank "
            f"holds 1/{self.tp} of these parameters, so such a term counts only this rank's part: the gradients "
            "would be one device's, but the loss value (what is logged, what ModelCheckpoint and EarlyStopping "
            "monitor) would not. What works: the optimizer's weight_decay (AdamW(weight_decay=...)) for an L2 "
            "penalty; tp_plan={'<layer>': 'replicate'} for the layers whose weights the step reads; or tp=1 "
            "(data parallelism computes it as one device does)."
        )
