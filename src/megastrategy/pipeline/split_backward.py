"""Split a stage's backward into the input gradient (B, now) and the weight gradients (W, later).

Works on the autograd graph the user's unchanged forward built. Call the nodes from which the
stage input's gradient is reachable the *input path*; every node that feeds one of them is on
it too, so B (``backward(inputs=[stage_input])``) computes each input-path node's complete
incoming gradient. A weight gradient leaves the input path at a *frontier* node, one with an
edge to a node off the path that leads to a leaf (e.g. ``AddmmBackward``: one edge to the
layer input, on the path, and one to the weight, off it). B records each frontier node's
incoming gradient (a pre-hook) while autograd skips the frontier's off-path outputs (the
``x^T dy`` products). W restarts autograd at the frontier nodes with those gradients and the
leaves as ``inputs``: only the off-path outputs are computed, nothing of B is redone, and the
gradients accumulate into ``.grad`` through the leaves' own accumulators, so
``post_accumulate_grad`` hooks (the data-parallel gradient buffer's) fire as in one backward.

Frontier nodes whose off-path parts reach a common leaf are restarted in one autograd call, so
each leaf accumulates once per W (the buffer counts its hooks). Inside such a call, a frontier
node may also be reached from another one along the input path; a pre-hook then replaces what
arrives by the recorded gradient, so nothing is counted twice.

When B cannot help (no stage input, or an output that does not depend on it), B does nothing
and W runs the whole backward. ``reuse_saved_gradients=False`` is the plain version, kept to
measure against: B as above, W a second backward from the output to the leaves.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGradients", "backward_input"]


class WeightGradients:
    """What B leaves for W: autograd calls still to run, each ``(roots, gradients, leaves, nodes)``
    (``leaves=None``: every leaf, as a plain backward)."""

    def __init__(self, calls: list[tuple[list, list, Optional[list[Tensor]], list[Node]]], recorded: dict) -> None:
        self._calls, self._recorded = calls, recorded

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (once; the graph goes with this object)."""
        calls, self._calls = self._calls, []
        for roots, grads, leaves, nodes in calls:
            handles = [n.register_prehook(_replace_by(self._recorded[n])) for n in nodes] if len(nodes) > 1 else []
            try:
                torch.autograd.backward(roots, grads, inputs=leaves, retain_graph=True)
            finally:
                for h in handles:
                    h.remove()
        self._recorded = {}


def backward_input(
    output: Tensor, grad: Optional[Tensor], stage_input: Optional[Tensor], *, reuse_saved_gradients: bool = True
) -> WeightGradients:
    """B: accumulate ``stage_input.grad`` from ``output`` (with incoming gradient ``grad``; ``None``
    for a scalar loss); return the W step."""
    root = output.grad_fn
    if root is None:
        return WeightGradients([], {})
    target = _accumulator(stage_input) if stage_input is not None and stage_input.requires_grad else None
    order = _post_order(root) if target is not None else []
    on_path = _input_path(order, target)
    if root not in on_path:  # nothing upstream depends on this stage: W is the whole backward
        return WeightGradients([([output], [grad], None, [])], {})
    if not reuse_saved_gradients:
        torch.autograd.backward(output, grad, inputs=[stage_input], retain_graph=True)
        leaves = [n.variable for n in order if _is_leaf(n) and n is not target]
        return WeightGradients([([output], [grad], leaves, [])], {})
    frontier = _frontier(order, on_path, target)
    recorded: dict[Node, tuple] = {}
    handles = [node.register_prehook(_recorder(recorded, node)) for node in frontier]
    try:
        torch.autograd.backward(output, grad, inputs=[stage_input], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return WeightGradients(_grouped_calls(frontier, recorded), recorded)


def _accumulator(leaf: Tensor) -> Node:
    """The node that accumulates a leaf's gradient (created lazily by autograd, hence the view)."""
    if leaf.grad_fn is not None:
        raise ValueError("the stage input must be a leaf tensor (the executor makes received activations leaves).")
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _post_order(root: Node) -> list[Node]:
    """Every node below ``root``, each after all of its children."""
    order, seen, stack = [], {root}, [(root, iter(_children(root)))]
    while stack:
        node, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            order.append(node)
        elif child not in seen:
            seen.add(child)
            stack.append((child, iter(_children(child))))
    return order


def _input_path(order: list[Node], target: Optional[Node]) -> set[Node]:
    """Nodes of ``order`` (children first) from which ``target`` is reachable, ``target`` included."""
    on_path: set[Node] = set()
    for node in order:
        if node is target or any(child in on_path for child in _children(node)):
            on_path.add(node)
    return on_path


def _is_leaf(node: Node) -> bool:
    return hasattr(node, "variable")


def _frontier(order: list[Node], on_path: set[Node], target: Node) -> dict[Node, list[Node]]:
    """Input-path nodes with an edge off the path that leads to leaves -> those leaves."""
    leaves_below: dict[Node, dict[Node, None]] = {}  # off-path node -> leaf accumulators under it
    frontier = {}
    for node in order:
        if node not in on_path:
            below = {node: None} if _is_leaf(node) else {}
            for child in _children(node):
                below.update(leaves_below[child])
            leaves_below[node] = below
        elif node is not target:
            found: dict[Node, None] = {}
            for child in _children(node):
                if child not in on_path:
                    found.update(leaves_below[child])
            if found:
                frontier[node] = list(found)
    return frontier


def _recorder(recorded: dict, node: Node):
    def record(grad_outputs: tuple) -> None:
        recorded[node] = tuple(grad_outputs)

    return record


def _replace_by(grads: tuple):
    return lambda grad_outputs: grads


def _grouped_calls(frontier: dict[Node, list[Node]], recorded: dict) -> list[tuple[list, list, list[Tensor], list[Node]]]:
    """One autograd call per set of frontier nodes that share a leaf."""
    group_of_leaf: dict[Node, int] = {}
    groups: list[list[Node]] = []
    for node, leaves in frontier.items():
        joined = sorted({group_of_leaf[leaf] for leaf in leaves if leaf in group_of_leaf})
        if joined:
            target = joined[0]
            for other in joined[1:]:
                groups[target] += groups[other]
                for moved in groups[other]:
                    for leaf in frontier[moved]:
                        group_of_leaf[leaf] = target
                groups[other] = []
        else:
            target = len(groups)
            groups.append([])
        groups[target].append(node)
        for leaf in leaves:
            group_of_leaf[leaf] = target
    calls = []
    for nodes in filter(None, groups):
        roots, grads = [], []
        for node in nodes:
            for i, g in enumerate(recorded.get(node, ())):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    grads.append(g)
        leaves = list({leaf: None for node in nodes for leaf in frontier[node]})
        if roots:
            calls.append((roots, grads, [leaf.variable for leaf in leaves], nodes))
    return calls
