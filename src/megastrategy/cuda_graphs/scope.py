"""``cuda_graph_scope``: which parts of each transformer block are captured as CUDA graphs.

Partial CUDA graphs capture only the parts of a layer whose shapes do not depend on the data
(Megatron-Core's ``--cuda-graph-modules`` / ``cuda_graph_scope`` with the Transformer Engine
implementation). The names follow Megatron's:

* ``"attn"``: the attention submodule of every block of the pipeline layer stack;
* ``"moe_router"``: the router of every :class:`~megastrategy.moe.MoELayer` in those blocks
  (gate, scores, top-k, auxiliary losses: fixed shapes for a fixed token count);
* ``"moe_preprocess"``: the dispatch preprocessing of those MoE layers (permutation metadata
  computed before the token all-to-all), when the dispatcher exposes it as ``preprocess``.

The all-to-all, whose sizes depend on the routing, and the expert computation always run
eagerly.

The user's module is not changed to find these: attention is recognised by type
(``nn.MultiheadAttention``, megastrategy's tensor-parallel attention) or by class name (Hugging
Face ``BertAttention``, ``GPT2Attention``, ``LlamaAttention``... any class whose name ends with
``Attention``), taking the outermost such submodule of each block; ``attention_modules`` names
them explicitly when neither applies.
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.attention import TensorParallelMultiheadAttention
from megastrategy.layers.random import TensorParallelRegionDropout
from megastrategy.moe.layer import MoELayer

__all__ = [
    "CUDA_GRAPH_SCOPES",
    "GraphTarget",
    "GraphTargets",
    "find_graph_targets",
    "validate_cuda_graph_scope",
]

CUDA_GRAPH_SCOPES = ("attn", "moe_router", "moe_preprocess")
_ATTENTION_TYPES = (nn.MultiheadAttention, TensorParallelMultiheadAttention)


def validate_cuda_graph_scope(
    scope: Any,
    *,
    device_type: Optional[str] = None,
    activation_checkpointing: Optional[str] = None,
) -> tuple[str, ...]:
    """Check ``cuda_graph_scope`` and return it as a tuple of distinct names (``()`` = off).

    ``scope``: ``None``, one name, or a list of names from :data:`CUDA_GRAPH_SCOPES`.
    ``device_type``: the strategy's device type when known; graphs need ``"cuda"``.
    ``activation_checkpointing``: ``"full"`` recomputes whole blocks during backward, which
    would run the captured parts again outside their forward, so it is refused; so is
    ``"selective"`` with ``"attn"`` (the recomputed attention core lies inside the graph).
    """
    if scope is None:
        return ()
    names = [scope] if isinstance(scope, str) else scope
    if not isinstance(names, (list, tuple)):
        raise MegatronConfigError(
            f"cuda_graph_scope={scope!r} must be a list of names from {list(CUDA_GRAPH_SCOPES)}, "
            f"e.g. cuda_graph_scope=['attn', 'moe_router'], or None to capture nothing."
        )
    unknown = [n for n in names if not isinstance(n, str) or n not in CUDA_GRAPH_SCOPES]
    if unknown:
        raise MegatronConfigError(
            f"cuda_graph_scope={list(names)!r}: {', '.join(repr(n) for n in unknown)} "
            f"{'is' if len(unknown) == 1 else 'are'} not a capturable part; the valid names are "
            f"{list(CUDA_GRAPH_SCOPES)} (the static parts of a layer: attention, the MoE router and the MoE "
            f"dispatch preprocessing; 'mlp', 'moe' and 'full_iteration' are not supported)."
        )
    result = tuple(dict.fromkeys(names))
    if "moe_preprocess" in result and "moe_router" not in result:
        raise MegatronConfigError(
            f"cuda_graph_scope={list(names)!r}: 'moe_preprocess' needs 'moe_router' too (as in Megatron-Core): "
            f"the preprocessing consumes the router's outputs, and graphing it alone keeps the router's launches "
            f"on the critical path. Use {list(result) + ['moe_router']!r}."
        )
    if result and device_type is not None and device_type != "cuda":
        raise MegatronConfigError(
            f"cuda_graph_scope={list(result)!r} needs a CUDA device (CUDA graphs), but the strategy runs on "
            f"{device_type!r}. Use cuda_graph_scope=None on {device_type}, or train on GPUs."
        )
    if result and activation_checkpointing == "full":
        raise MegatronConfigError(
            f"cuda_graph_scope={list(result)!r} with activation_checkpointing='full': full recompute runs every "
            f"block again during backward, outside the forward whose static buffers the graphs own. Use "
            f"activation_checkpointing='selective' (without 'attn') or None, or cuda_graph_scope=None."
        )
    if "attn" in result and activation_checkpointing == "selective":
        raise MegatronConfigError(
            f"cuda_graph_scope={list(result)!r} with activation_checkpointing='selective': selective recompute "
            f"checkpoints the attention core, which 'attn' captures inside a graph. Drop 'attn' from "
            f"cuda_graph_scope, or use activation_checkpointing=None."
        )
    return result


@dataclass(frozen=True, eq=False)
class GraphTarget:
    """One callable to capture: ``getattr(owner, attr)`` (a submodule's ``forward``, or a
    dispatcher method) in block ``layer`` (global index in the layer stack), run in ``chunk``.

    ``module`` holds the parameters the graph reads (``None`` when it reads none) and
    ``mode_module`` the ``training`` flag that decides between graph and eager.
    """

    name: str
    kind: str
    layer: int
    chunk: int
    owner: Any
    attr: str
    module: Optional[nn.Module]
    mode_module: nn.Module


@dataclass
class GraphTargets:
    """What :func:`find_graph_targets` found, and what it had to leave out (``skipped``: one
    ``(kind, name, reason)`` per block where a requested part was not capturable)."""

    targets: list[GraphTarget] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[GraphTarget]:
        return [t for t in self.targets if t.kind == kind]


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, _ATTENTION_TYPES) or type(module).__name__.endswith("Attention")


def _outermost(block: nn.Module, predicate) -> list[tuple[str, nn.Module]]:
    """Submodules of ``block`` matching ``predicate`` that have no matching ancestor inside it,
    and do not lie inside an MoE layer."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, MoELayer):
                continue
            if predicate(child):
                found.append((path, child))
            else:
                visit(f"{path}.", child)

    visit("", block)
    return found


def _check_graph_safe_dropout(name: str, module: nn.Module) -> None:
    """Dropout drawn from the tensor-parallel RNG tracker swaps the CUDA generator's state,
    which cannot happen while a graph is captured."""
    for sub_name, sub in module.named_modules():
        tp_dropout = isinstance(sub, TensorParallelRegionDropout) and sub.p > 0
        tp_attention = (
            isinstance(sub, TensorParallelMultiheadAttention) and sub.dropout > 0 and sub.rng_tracker is not None
        )
        if tp_dropout or tp_attention:
            where = f"{name}.{sub_name}" if sub_name else name
            raise MegatronConfigError(
                f"cuda_graph_scope contains 'attn', but {where} applies dropout (p>0) drawn from the "
                f"tensor-parallel RNG tracker, which swaps the CUDA generator's state: that is not allowed while "
                f"a CUDA graph is captured. Set the attention dropout to 0, or drop 'attn' from cuda_graph_scope."
            )


def _block_items(stack: nn.Module) -> list[tuple[int, nn.Module]]:
    items = []
    for position, (name, block) in enumerate(stack.named_children()):
        items.append((int(name) if name.isdigit() else position, block))
    return items


def find_graph_targets(
    stack: nn.Module,
    scope: Iterable[str],
    *,
    stack_path: str = "",
    chunks: Optional[Sequence[Sequence[int]]] = None,
    attention_modules: Optional[Sequence[str]] = None,
) -> GraphTargets:
    """The callables of ``scope`` in the blocks of ``stack`` (the pipeline layer stack: an
    ``nn.ModuleList``, or a stage's ``LocalLayers`` whose children are named by global index).

    ``chunks``: the stage's global layer indices per chunk (``PipelineStage.chunks``); a
    block's targets run in the chunk holding it (default: every block in chunk 0).
    ``attention_modules``: glob patterns of submodule paths relative to a block (e.g.
    ``["attn"]``, ``["self_attn"]``) that override the automatic attention detection.

    Call it after every rewrite of the module (tensor-parallel plan, ``MoELayer.shard``, the
    pipeline cut): the targets are the objects that will run.
    """
    scope = validate_cuda_graph_scope(list(scope))
    chunk_of = {}
    for c, layers in enumerate(chunks or []):
        for layer in layers:
            chunk_of[int(layer)] = c
    prefix = f"{stack_path}." if stack_path else ""
    result = GraphTargets()
    blocks = _block_items(stack)
    for index, block in blocks:
        chunk = chunk_of.get(index, 0)
        block_name = f"{prefix}{index}"
        if "attn" in scope:
            _add_attention_targets(result, block, block_name, index, chunk, attention_modules)
        for path, moe in [(n, m) for n, m in block.named_modules() if isinstance(m, MoELayer)]:
            _add_moe_targets(result, scope, moe, f"{block_name}.{path}", index, chunk)
    _check_scope_found(result, scope, blocks, prefix, stack_path)
    skipped_pre = [s for s in result.skipped if s[0] == "moe_preprocess"]
    if skipped_pre:
        warnings.warn(
            f"cuda_graph_scope 'moe_preprocess': {skipped_pre[0][2]} ({len(skipped_pre)} MoE layer(s)).",
            stacklevel=2,
        )
    return result


def _attention_of(block: nn.Module, attention_modules: Optional[Sequence[str]]) -> list[tuple[str, nn.Module]]:
    """The outermost attention submodules of ``block``: those the globs name, else detected."""
    if not attention_modules:
        return _outermost(block, _is_attention)
    found = [
        (n, m) for n, m in block.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in attention_modules)
    ]
    return [(n, m) for n, m in found if not any(n.startswith(f"{o}.") for o, _ in found)]


def _add_attention_targets(
    result: GraphTargets,
    block: nn.Module,
    block_name: str,
    index: int,
    chunk: int,
    attention_modules: Optional[Sequence[str]],
) -> None:
    found = _attention_of(block, attention_modules)
    if not found:
        result.skipped.append(("attn", block_name, "no attention submodule"))
    for path, module in found:
        name = f"{block_name}.{path}"
        _check_graph_safe_dropout(name, module)
        result.targets.append(GraphTarget(name, "attn", index, chunk, module, "forward", module, module))


def _add_moe_targets(result: GraphTargets, scope: list[str], moe: MoELayer, name: str, index: int, chunk: int) -> None:
    """The router, and the dispatcher's preprocess step where the routing cannot change its shapes."""
    if "moe_router" in scope:
        router = moe.router
        result.targets.append(GraphTarget(f"{name}.router", "moe_router", index, chunk, router, "forward", router, moe))
    if "moe_preprocess" not in scope:
        return
    preprocess = getattr(moe.dispatcher, "preprocess", None)
    if moe.router.capacity_factor is not None:
        result.skipped.append(
            (
                "moe_preprocess",
                name,
                f"capacity_factor={moe.router.capacity_factor} drops tokens, so the number of rows to "
                "dispatch depends on the routing; only the router is captured",
            )
        )
    elif callable(preprocess):
        result.targets.append(
            GraphTarget(
                f"{name}.dispatcher.preprocess", "moe_preprocess", index, chunk, moe.dispatcher,
                "preprocess", None, moe,
            )
        )
    else:
        result.skipped.append(
            (
                "moe_preprocess",
                name,
                f"{type(moe.dispatcher).__name__} has no separate preprocess step "
                "(its dispatch mixes the permutation with the all-to-all); only the router is captured",
            )
        )


def _check_scope_found(
    result: GraphTargets, scope: list[str], blocks: list[tuple[int, nn.Module]], prefix: str, stack_path: str
) -> None:
    """A scope entry that found nothing in any block is a configuration error, not a no-op."""
    if "attn" in scope and not result.of_kind("attn") and blocks:
        first = f"{prefix}{blocks[0][0]}"
        raise MegatronConfigError(
            f"cuda_graph_scope contains 'attn', but no block of {stack_path or 'the layer stack'} has an attention "
            f"submodule (looked for nn.MultiheadAttention, TensorParallelMultiheadAttention, or a class whose name "
            f"ends with 'Attention'; block {first} is a {type(blocks[0][1]).__name__} that computes attention "
            f"inline). Put the attention in a submodule and pass attention_modules=['<its name>'], or drop 'attn' "
            f"from cuda_graph_scope."
        )
    if "moe_router" in scope and not result.of_kind("moe_router"):
        raise MegatronConfigError(
            f"cuda_graph_scope contains 'moe_router', but no block of {stack_path or 'the layer stack'} holds a "
            f"megastrategy.moe.MoELayer. Drop 'moe_router' (and 'moe_preprocess') from cuda_graph_scope, or use "
            f"MoELayer for the MLPs."
        )
