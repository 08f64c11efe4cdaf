"""Sequence parallelism on an unchanged, tensor-parallel module.

With tensor parallelism alone every TP rank holds the whole ``[batch, seq, hidden]``
activations outside the column/row-parallel regions (layer norms, dropout, residual
adds) and computes them redundantly. Sequence parallelism splits those regions along the
sequence dimension over the TP ranks:

* a column-parallel layer all-gathers the sequence of its input (backward:
  reduce-scatter) instead of the identity/all-reduce copy;
* a row-parallel layer reduce-scatters its partial products along the sequence
  (backward: all-gather) instead of all-reducing them;
* every parameter that is replicated over TP but used on a sequence slice (layer-norm
  weights and biases, row-parallel biases) only sees this rank's tokens, so its gradient
  is summed over TP before the optimizer step (:func:`allreduce_sequence_parallel_grads`);
* dropout inside the blocks runs on the per-TP-rank stream of the
  :class:`~megastrategy.layers.random.ModelParallelRNGTracker` (each rank holds different
  tokens; sharing the default stream would give every slice the same mask).

The user's ``forward`` is not changed, so where the sequence is split depends on what the
blocks' code tolerates. :func:`enable_sequence_parallel` uses one of two layouts:

``"residual"`` (the Megatron layout) for blocks whose code is known:
    Hugging Face ``BertLayer``, ``GPT2Block``, ``{Llama,Mistral,Qwen2,Qwen3}DecoderLayer``
    and ``torch.nn.TransformerEncoderLayer``. The whole residual stream is split: the
    hidden states are scattered along the sequence by a forward pre-hook on the first
    block of the layer stack and gathered back by a forward hook on the last one (so the
    embeddings, the attention mask, the pooler and the head see the full sequence; only
    hidden states are ever split). Attention needs every token and its code reads the
    sequence length from its input, so the attention module (``BertSelfAttention``,
    ``GPT2Attention``, ``LlamaAttention``, the tensor-parallel ``nn.MultiheadAttention``)
    all-gathers its input in a forward pre-hook and its column-parallel projections take
    that gathered input as is; the MLP's column layers gather themselves.

``"norms"`` for user blocks (a ``tp_plan`` over the user's own modules):
    user code typically reads ``B, T, _ = x.shape`` from the block input and reshapes the
    projections with ``T``, so the block input (the residual stream) must keep the full
    sequence. Only the normalization layers are split: each ``LayerNorm``/``RMSNorm``
    (any module whose class name ends in ``Norm``) inside a block runs on this rank's
    slice of the sequence (its input is scattered by a pre-hook) and the column-parallel
    layers all-gather its output; row-parallel layers keep their all-reduce. This is
    exact for pre-norm blocks whose norms feed column-parallel layers (the common GPT
    block); a block whose norm output goes elsewhere (post-norm) fails at the first batch
    with an error naming it.

Everything is configured once (hooks and layer attributes); parameter names and shapes do
not change. Sequence lengths must be divisible by the tensor-parallel size (checked at the
first split, naming the length).

Not supported (``MegatronConfigError``): ``tp == 1``; cross-attention
(``nn.TransformerDecoderLayer``, BERT/GPT-2 with ``add_cross_attention``); user blocks
without a normalization module.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.lora_sequence_parallel import sharded_column_adapters, whole_adapter_params
from megastrategy.layers.mappings import (
    ProcessGroupRef,
    SharedInputCopy,
    all_gather,
    all_reduce,
    gather_from_sequence_parallel_region,
    group_rank,
    group_world_size,
    scatter_to_sequence_parallel_region,
)

__all__ = [
    "SequenceParallelSetup",
    "SharedSequenceGather",
    "PreGatheredInput",
    "validate_sequence_parallel",
    "check_sequence_parallel_support",
    "check_sequence_length",
    "enable_sequence_parallel",
    "sequence_parallel_grad_params",
    "allreduce_sequence_parallel_grads",
    "gather_sequence_for_replicated_consumer",
]

#: attribute set to ``True`` on parameters whose gradient must be summed over TP
SP_PARAM_ATTR = "sequence_parallel"

_LLAMA_FAMILY = ("Llama", "Mistral", "Qwen2", "Qwen3")


# ----------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------
def validate_sequence_parallel(*, tp: int, sequence_parallel: bool) -> None:
    """Raise :class:`MegatronConfigError` for ``sequence_parallel=True`` without tensor
    parallelism (the split runs over the TP ranks)."""
    if sequence_parallel and tp < 2:
        raise MegatronConfigError(
            f"sequence_parallel=True with tp={tp}: sequence parallelism splits the sequence over the "
            "tensor-parallel ranks and needs tp > 1; use tp >= 2 or sequence_parallel=False."
        )


def check_sequence_length(length: int, tp: int, where: str = "") -> None:
    """Raise :class:`MegatronConfigError` when ``length`` cannot be split over ``tp`` ranks."""
    if tp > 1 and length % tp:
        at = f" at {where}" if where else ""
        raise MegatronConfigError(
            f"sequence_parallel=True: the batch has sequence length {length}{at}, which is not divisible by "
            f"tp={tp}; pad (or truncate) sequences to a multiple of {tp}, or use sequence_parallel=False."
        )


# ----------------------------------------------------------------------------------------
# autograd pieces
# ----------------------------------------------------------------------------------------
def _split(x: Tensor, group, dim: int) -> Tensor:
    world = group_world_size(group)
    k = x.size(dim) // world
    return x.narrow(dim, group_rank(group) * k, k).contiguous()


class _GatherSplitGrad(torch.autograd.Function):
    """Forward: all-gather ``dim``. Backward: keep this rank's slice of the gradient.

    For the end of the split region, where the consumer (pooler, head, final norm) is
    replicated over TP and so produces the same, complete gradient on every TP rank.
    """

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, ctx.dim), None, None


def gather_sequence_for_replicated_consumer(x: Tensor, group, dim: int) -> Tensor:
    """All-gather the sequence of ``x`` for a consumer replicated over TP (backward: split)."""
    if group_world_size(group) == 1:
        return x
    return _GatherSplitGrad.apply(x, group, dim)


class SharedSequenceGather:
    """``gather_from_sequence_parallel_region`` shared by the column layers fed one tensor.

    Calling it again with the same tensor (same object, same autograd version) returns the
    same gathered tensor, so e.g. ``gate_proj``/``up_proj`` (or ``q``/``k``/``v``) pay for
    one all-gather and one backward reduce-scatter. A tensor this object produced is
    returned as is. Only the last input is remembered, through a weak reference.
    """

    def __init__(self, group, dim: int):
        self._group_ref = ProcessGroupRef(group)
        self.dim = int(dim)
        self._ref: Optional[weakref.ReferenceType] = None
        self._version = -1
        self._out: Optional[Tensor] = None

    @property
    def group(self):
        return self._group_ref.group

    def __deepcopy__(self, memo):
        return type(self)(self.group, self.dim)

    def __getstate__(self):
        raise TypeError("SharedSequenceGather holds a process group and cannot be pickled")

    def __call__(self, x: Tensor) -> Tensor:
        if group_world_size(self.group) == 1:
            return x
        out = self._out
        if out is not None and x is out:
            return x
        ref = self._ref
        if ref is not None and ref() is x and self._version == x._version and out is not None:
            return out
        out = gather_from_sequence_parallel_region(x, self.group, self.dim)
        self._ref, self._out = None, None
        try:
            me = weakref.ref(self)

            def _forget(dead, me=me):
                obj = me()
                if obj is not None and obj._ref is dead:
                    obj._ref, obj._out = None, None

            self._ref = weakref.ref(x, _forget)
        except TypeError:
            return out
        self._version = x._version
        self._out = out
        return out

    def __repr__(self) -> str:
        return f"SharedSequenceGather(world={group_world_size(self.group)}, dim={self.dim})"


class PreGatheredInput:
    """``input_copy`` of a column layer whose input was already all-gathered by a forward
    pre-hook of an enclosing module (whose backward reduce-scatter also sums this layer's
    input gradient over TP): the identity, forward and backward."""

    def __call__(self, x: Tensor) -> Tensor:
        return x

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return "PreGatheredInput()"


PRE_GATHERED = PreGatheredInput()


# ----------------------------------------------------------------------------------------
# hooks
# ----------------------------------------------------------------------------------------
def _first_tensor(args: tuple, kwargs: dict, names: tuple[str, ...] = ("hidden_states",)):
    """(where, tensor) of the hidden states a block/attention module is called with."""
    if args and isinstance(args[0], Tensor):
        return ("arg", 0), args[0]
    for n in names:
        v = kwargs.get(n)
        if isinstance(v, Tensor):
            return ("kw", n), v
    return None, None


def _replace(args: tuple, kwargs: dict, old: Tensor, new: Tensor) -> tuple[tuple, dict]:
    """Replace every occurrence (by identity) of ``old`` among the arguments by ``new``."""
    args = tuple(new if a is old else a for a in args)
    kwargs = {k: (new if v is old else v) for k, v in kwargs.items()}
    return args, kwargs


_SP_SHARD_MARK = "_megastrategy_sequence_shard"


class _StackScatter:
    """Pre-hook of the stack's first block: keep this rank's slice of the hidden states."""

    def __init__(self, group, dim: int, name: str):
        self._group_ref, self.dim, self.name = ProcessGroupRef(group), dim, name

    def __call__(self, module, args, kwargs):
        where, x = _first_tensor(args, kwargs)
        if x is None:
            raise MegatronConfigError(
                f"sequence_parallel=True: {self.name} was called without a hidden-state tensor (first positional "
                "argument or hidden_states=...), so the sequence cannot be split where the layer stack starts."
            )
        tp = group_world_size(self._group_ref.group)
        check_sequence_length(x.size(self.dim), tp, f"the input of {self.name} (dim {self.dim})")
        y = scatter_to_sequence_parallel_region(x, self._group_ref.group, self.dim)
        return _replace(args, kwargs, x, y)


class _StackGather:
    """Forward hook of the stack's last block: gather the full sequence again."""

    def __init__(self, group, dim: int):
        self._group_ref, self.dim = ProcessGroupRef(group), dim

    def __call__(self, module, args, output):
        group = self._group_ref.group
        if isinstance(output, Tensor):
            return gather_sequence_for_replicated_consumer(output, group, self.dim)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
            first = gather_sequence_for_replicated_consumer(output[0], group, self.dim)
            return type(output)([first, *output[1:]]) if isinstance(output, list) else (first, *output[1:])
        if hasattr(output, "last_hidden_state") and isinstance(output.last_hidden_state, Tensor):
            output.last_hidden_state = gather_sequence_for_replicated_consumer(output.last_hidden_state, group, self.dim)
            return output
        raise MegatronConfigError(
            f"sequence_parallel=True: the last block returned {type(output).__name__}; the sequence can only be "
            "gathered from a tensor or a tuple whose first element is the hidden states."
        )


class _OwnerGather:
    """Pre-hook of an attention module: all-gather its (sequence-split) hidden-state input;
    every argument that is the same tensor (``query is key is value``) gets the same result."""

    def __init__(self, group, dim: int):
        self._group_ref, self.dim = ProcessGroupRef(group), dim

    def __call__(self, module, args, kwargs):
        where, x = _first_tensor(args, kwargs, ("hidden_states", "query", "x"))
        if x is None:
            return None
        y = gather_from_sequence_parallel_region(x, self._group_ref.group, self.dim)
        return _replace(args, kwargs, x, y)


class _NormScatter:
    """``"norms"`` layout: the norm runs on this rank's slice of the sequence."""

    def __init__(self, group, dim: int, name: str):
        self._group_ref, self.dim, self.name = ProcessGroupRef(group), dim, name

    def pre(self, module, args):
        if not args or not isinstance(args[0], Tensor):
            return None
        x = args[0]
        check_sequence_length(x.size(self.dim), group_world_size(self._group_ref.group), f"the input of {self.name}")
        return (scatter_to_sequence_parallel_region(x, self._group_ref.group, self.dim), *args[1:])

    def post(self, module, args, output):
        if isinstance(output, Tensor):
            setattr(output, _SP_SHARD_MARK, True)
        return None


class _ColumnInputCheck:
    """``"norms"`` layout: a column layer must be fed a sequence-split norm output."""

    def __init__(self, name: str, block_name: str):
        self.name, self.block_name = name, block_name

    def __call__(self, module, args):
        x = args[0] if args else None
        if isinstance(x, Tensor) and not getattr(x, _SP_SHARD_MARK, False):
            raise MegatronConfigError(
                f"sequence_parallel=True: {self.name} (column-parallel) is not fed the output of a normalization "
                f"layer of {self.block_name}. For user blocks sequence parallelism splits only the LayerNorm/RMSNorm "
                "regions, whose outputs must go straight into column-parallel layers (pre-norm blocks). Use "
                "sequence_parallel=False for this model."
            )
        return None


class _BlockShapeCheck:
    """``"norms"`` layout: a block must return the full sequence (catches post-norm blocks)."""

    def __init__(self, dim: int, name: str):
        self.dim, self.name = dim, name

    def __call__(self, module, args, kwargs, output):
        _, x = _first_tensor(args, kwargs)
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(x, Tensor) and isinstance(out, Tensor) and out.dim() > self.dim and x.dim() > self.dim:
            if out.size(self.dim) != x.size(self.dim):
                raise MegatronConfigError(
                    f"sequence_parallel=True: {self.name} returned {out.size(self.dim)} positions along dim "
                    f"{self.dim} for an input of {x.size(self.dim)}; its normalization output leaves the block "
                    "(post-norm). For user blocks only pre-norm layouts are supported; use sequence_parallel=False."
                )
        return None


# ----------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _KnownBlock:
    arch: str
    owners: tuple[str, ...]  # attention modules (paths in the block) whose input is gathered by a pre-hook


def _known_block(block: nn.Module) -> Optional[_KnownBlock]:
    cls = type(block).__name__
    if isinstance(block, nn.TransformerDecoderLayer):
        raise MegatronConfigError(
            "sequence_parallel=True: nn.TransformerDecoderLayer (cross-attention over a memory that is not split) is "
            "not supported; supported blocks: Hugging Face BertLayer, GPT2Block, Llama/Mistral/Qwen2/Qwen3 decoder "
            "layers, nn.TransformerEncoderLayer, and pre-norm user blocks. Use sequence_parallel=False."
        )
    if isinstance(block, nn.TransformerEncoderLayer):
        return _KnownBlock("torch", ("self_attn",))
    if cls == "BertLayer":
        if getattr(block, "crossattention", None) is not None:
            raise MegatronConfigError(
                "sequence_parallel=True: BERT with add_cross_attention=True is not supported (the encoder states "
                "are not split); use sequence_parallel=False."
            )
        return _KnownBlock("bert", ("attention.self",))
    if cls == "GPT2Block":
        if getattr(block, "crossattention", None) is not None:
            raise MegatronConfigError(
                "sequence_parallel=True: GPT-2 with add_cross_attention=True is not supported (the encoder states "
                "are not split); use sequence_parallel=False."
            )
        return _KnownBlock("gpt2", ("attn",))
    for prefix in _LLAMA_FAMILY:
        if cls == f"{prefix}DecoderLayer":
            return _KnownBlock(prefix.lower(), ("self_attn",))
    return None


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm")


def _get(root: nn.Module, path: str) -> Optional[nn.Module]:
    m: Any = root
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m if isinstance(m, nn.Module) else None


def _is_dropout(m: nn.Module) -> bool:
    return isinstance(m, nn.Dropout)


def _norms_of(block: nn.Module) -> list[tuple[str, nn.Module]]:
    norms = [(n, m) for n, m in block.named_modules() if n and _is_norm(m)]
    # outermost norms only (a norm module may wrap another)
    return [(n, m) for n, m in norms if not any(n.startswith(o + ".") for o, _ in norms if o != n)]


def _no_norm_error(name: str, block: nn.Module) -> MegatronConfigError:
    return MegatronConfigError(
        f"sequence_parallel=True: {name} ({type(block).__name__}) has no LayerNorm/RMSNorm module. For user blocks "
        "sequence parallelism splits the normalization regions; supported without norms: Hugging Face BertLayer, "
        "GPT2Block, Llama/Mistral/Qwen2/Qwen3 decoder layers and nn.TransformerEncoderLayer. Use "
        "sequence_parallel=False."
    )


def check_sequence_parallel_support(module: nn.Module, pipeline_layers: Optional[str] = None) -> str:
    """Pure check (no process group; call it where the plan is resolved, before any
    collective): raise :class:`MegatronConfigError` if the layer stack's blocks cannot run
    sequence parallel; return the layout that will be used (``"residual"`` or ``"norms"``)."""
    from megastrategy.pipeline.stage import find_layer_stack

    path, stack = find_layer_stack(module, pipeline_layers)
    known = [_known_block(b) for b in stack]
    if known[0] is not None:
        return "residual"
    for i, b in enumerate(stack):
        if not _norms_of(b):
            raise _no_norm_error(f"{path}.{i}", b)
    return "norms"


@dataclass
class SequenceParallelSetup:
    """What :func:`enable_sequence_parallel` did (for logs and tests)."""

    layout: str  # "residual" or "norms"
    sequence_dim: int
    stack_path: str
    block_type: str
    num_blocks: int
    gathered_modules: list[str] = field(default_factory=list)
    split_norms: list[str] = field(default_factory=list)
    column_layers: list[str] = field(default_factory=list)
    row_layers: list[str] = field(default_factory=list)
    tp_stream_dropouts: list[str] = field(default_factory=list)
    grad_params: list[str] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list, repr=False)

    def describe(self) -> str:
        lines = [
            f"sequence parallel: layout={self.layout}, dim={self.sequence_dim}, stack={self.stack_path} "
            f"({self.num_blocks} x {self.block_type})",
        ]
        if self.layout == "residual":
            lines.append("  hidden states split from the first block's input to the last block's output")
            lines.append(f"  attention inputs gathered: {len(self.gathered_modules)}")
        else:
            lines.append(f"  norms on a sequence slice: {len(self.split_norms)} (residual stream kept whole)")
        lines.append(
            f"  column layers gathering: {len(self.column_layers)}, row layers reduce-scattering: "
            f"{len(self.row_layers)}, dropouts on the TP stream: {len(self.tp_stream_dropouts)}, "
            f"parameters with TP-summed gradients: {len(self.grad_params)}"
        )
        return "\n".join(lines)

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def enable_sequence_parallel(
    module: nn.Module,
    plan: Any,
    *,
    tp_group,
    pipeline_layers: Optional[str] = None,
    rng_tracker: Any = None,
    sequence_dim: Optional[int] = None,
) -> SequenceParallelSetup:
    """Turn on sequence parallelism for the layer stack of an already tensor-parallel ``module``.

    Call after :func:`~megastrategy.layers.plan.apply_tp_plan` and before the pipeline cut
    and the gradient buffer (it changes no parameter; it sets attributes of the
    column/row-parallel layers, replaces ``nn.Dropout`` modules of the blocks by
    :class:`~megastrategy.layers.random.TensorParallelRegionDropout` and installs hooks).

    Args:
        module: the module ``apply_tp_plan`` rewrote (e.g. the LightningModule).
        plan: its :class:`~megastrategy.layers.plan.ResolvedPlan` (``tp_size`` is checked).
        tp_group: the tensor-parallel group.
        pipeline_layers: dotted path of the layer stack (default: found as the pipeline finds it).
        rng_tracker: the :class:`ModelParallelRNGTracker` dropout in the blocks draws from;
            needed when the blocks contain ``nn.Dropout`` modules.
        sequence_dim: the sequence dimension of the hidden states. Default: from the known
            block (batch-first Hugging Face models: 1; ``nn.TransformerEncoderLayer``: 1 if
            ``batch_first`` else 0); 1 for user blocks (``[batch, seq, hidden]``).

    Returns a :class:`SequenceParallelSetup`. Parameters whose gradient must be summed over
    TP are tagged (``param.sequence_parallel = True``); collect them with
    :func:`sequence_parallel_grad_params` after the pipeline cut.
    """
    from megastrategy.pipeline.stage import find_layer_stack

    _check_plan_matches_group(plan, group_world_size(tp_group))
    if getattr(module, "_megastrategy_sequence_parallel", None) is not None:
        return module._megastrategy_sequence_parallel
    path, stack = find_layer_stack(module, pipeline_layers)
    blocks = list(stack)
    known = _known_block(blocks[0])
    for b in blocks[1:]:
        _known_block(b)  # raises for unsupported blocks anywhere in the stack
    _check_blocks_sharded(path, blocks)
    setup = SequenceParallelSetup(
        layout="residual" if known is not None else "norms",
        sequence_dim=int(_default_sequence_dim(known, blocks[0]) if sequence_dim is None else sequence_dim),
        stack_path=path,
        block_type=type(blocks[0]).__name__,
        num_blocks=len(blocks),
    )
    installer = _SequenceParallelInstaller(module, setup, tp_group, rng_tracker)
    if setup.layout == "residual":
        installer.residual_layout(blocks, known)
    else:
        installer.norms_layout(blocks)
    module._megastrategy_sequence_parallel = setup
    return setup


def _check_plan_matches_group(plan: Any, tp: int) -> None:
    validate_sequence_parallel(tp=tp, sequence_parallel=True)
    plan_tp = getattr(plan, "tp_size", tp)
    if plan_tp != tp:
        raise MegatronConfigError(
            f"enable_sequence_parallel: the plan was resolved for tp={plan_tp} but the tensor-parallel group has "
            f"{tp} ranks."
        )


def _check_blocks_sharded(path: str, blocks: list[nn.Module]) -> None:
    from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear

    if not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for b in blocks for m in b.modules()):
        raise MegatronConfigError(
            f"sequence_parallel=True: no column/row-parallel layer in the blocks of {path} "
            f"({type(blocks[0]).__name__}); sequence parallelism needs the tensor-parallel plan to shard the blocks."
        )


def _default_sequence_dim(known: Optional[_KnownBlock], first: nn.Module) -> int:
    """1 (``[batch, seq, hidden]``), except a ``nn.TransformerEncoderLayer`` that is not batch-first."""
    if known is not None and known.arch == "torch":
        return 1 if getattr(first.self_attn, "batch_first", False) else 0
    return 1


class _SequenceParallelInstaller:
    """Sets the column/row layers of each block to sequence-parallel mode, installs the
    scatter/gather hooks of one layout, and records all of it in ``setup``."""

    def __init__(self, module: nn.Module, setup: SequenceParallelSetup, tp_group, rng_tracker: Any) -> None:
        self.setup = setup
        self.tp_group = tp_group
        self.dim = setup.sequence_dim
        self.rng_tracker = rng_tracker
        self.names = {id(m): n for n, m in module.named_modules()}
        self.param_names = {id(p): n for n, p in module.named_parameters()}
        # one SharedSequenceGather per SharedInputCopy the plan created (layers fed one tensor)
        self.shared: dict[int, SharedSequenceGather] = {}

    def name_of(self, m: nn.Module) -> str:
        return self.names.get(id(m), type(m).__name__)

    def tag(self, p: nn.Parameter) -> None:
        """Mark a replicated parameter used on the sequence slice: its gradient is summed over TP."""
        from megastrategy.layers.shard_spec import get_shard_spec

        if p.requires_grad and get_shard_spec(p) is None and not getattr(p, SP_PARAM_ATTR, False):
            setattr(p, SP_PARAM_ATTR, True)
            self.setup.grad_params.append(self.param_names.get(id(p), "?"))

    def column_gather(self, layer: nn.Module):
        ic = layer.input_copy
        if isinstance(ic, SharedInputCopy):
            if id(ic) not in self.shared:
                self.shared[id(ic)] = SharedSequenceGather(self.tp_group, self.dim)
            return self.shared[id(ic)]
        if isinstance(ic, (SharedSequenceGather, PreGatheredInput)):
            return ic
        if ic is not None:
            raise MegatronConfigError(
                f"sequence_parallel=True: {self.name_of(layer)} has a custom input_copy ({ic!r}); cannot make it "
                "gather the sequence."
            )
        return None

    # -- residual layout: the hidden states stay split between blocks ------------------------
    def residual_layout(self, blocks: list[nn.Module], known: _KnownBlock) -> None:
        for b in blocks:
            self._residual_block(b, known)
        first, last = blocks[0], blocks[-1]
        scatter = _StackScatter(self.tp_group, self.dim, self.name_of(first))
        self.setup.handles.append(first.register_forward_pre_hook(scatter, with_kwargs=True))
        self.setup.handles.append(last.register_forward_hook(_StackGather(self.tp_group, self.dim)))
        for b in blocks:
            self._dropouts_to_tp_stream(b)

    def _residual_block(self, b: nn.Module, known: _KnownBlock) -> None:
        from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear
        from megastrategy.layers.multi_query import MultiQueryPackedLinear

        owners = [self._gathering_owner(b, opath) for opath in known.owners]
        in_owner = {id(m) for o in owners for m in o.modules()}
        for m in b.modules():
            if isinstance(m, (ColumnParallelLinear, MultiQueryPackedLinear)):  # whole k/v: the same gathered input
                m.sequence_parallel, m.sequence_dim = True, self.dim
                m.input_copy = PRE_GATHERED if id(m) in in_owner else self.column_gather(m)
                self.setup.column_layers.append(self.name_of(m))
            elif isinstance(m, RowParallelLinear):
                self._row_layer(m)
        # replicated parameters used on the sequence slice: everything but the attention modules
        # (which run on the gathered sequence) and the sharded weights
        for m in b.modules():
            if id(m) in in_owner:
                continue
            for p in m.parameters(recurse=False):
                self.tag(p)
        for p in whole_adapter_params(b, row_split=True):  # also inside the attention modules
            self.tag(p)

    def _gathering_owner(self, b: nn.Module, opath: str) -> nn.Module:
        """The attention module at ``opath`` of block ``b``, hooked to gather its input."""
        from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear

        owner = _get(b, opath)
        if owner is None:
            raise MegatronConfigError(
                f"sequence_parallel=True: {self.name_of(b)} ({type(b).__name__}) has no {opath!r} module."
            )
        if not any(isinstance(m, ColumnParallelLinear) for m in owner.modules()) or not any(
            isinstance(m, RowParallelLinear) for m in b.modules()
        ):
            raise MegatronConfigError(
                f"sequence_parallel=True: the attention of {self.name_of(b)} ({type(owner).__name__}) is not "
                "tensor-parallel (no column-parallel projections, or no row-parallel output projection); "
                "shard it (tp_plan 'auto', or column/row entries for its projections) or use "
                "sequence_parallel=False."
            )
        gather = _OwnerGather(self.tp_group, self.dim)
        self.setup.handles.append(owner.register_forward_pre_hook(gather, with_kwargs=True))
        self.setup.gathered_modules.append(self.name_of(owner))
        return owner

    def _row_layer(self, m: nn.Module) -> None:
        if not m.input_is_parallel:
            raise MegatronConfigError(
                f"sequence_parallel=True: {self.name_of(m)} is row-parallel with input_is_parallel=False; "
                "feed it the output of a column-parallel layer."
            )
        m.sequence_parallel, m.sequence_dim = True, self.dim
        self.setup.row_layers.append(self.name_of(m))
        if m.bias is not None:
            self.tag(m.bias)

    def _dropouts_to_tp_stream(self, b: nn.Module) -> None:
        """Dropout on split (or TP-sharded) activations draws from the per-TP-rank stream."""
        from megastrategy.layers.random import TensorParallelRegionDropout

        for parent in list(b.modules()):
            for attr, child in list(parent._modules.items()):
                if child is None or not _is_dropout(child) or isinstance(child, TensorParallelRegionDropout):
                    continue
                if self.rng_tracker is None:
                    raise MegatronConfigError(
                        f"sequence_parallel=True: {self.name_of(child)} is a dropout on sequence-split activations "
                        "and needs the per-TP-rank stream; pass rng_tracker=ModelParallelRNGTracker(...)."
                    )
                new = TensorParallelRegionDropout.from_dropout(child, self.rng_tracker)
                setattr(parent, attr, new)
                self.setup.tp_stream_dropouts.append(self.name_of(child))

    # -- norms layout: only the norms run on a sequence slice ---------------------------------
    def norms_layout(self, blocks: list[nn.Module]) -> None:
        from megastrategy.layers.linear import ColumnParallelLinear
        from megastrategy.layers.multi_query import MultiQueryPackedLinear

        for b in blocks:
            self._split_norms(b)
            adapters = sharded_column_adapters(b)  # fed A's output (split like the norm's), not a norm's
            for m in b.modules():
                if isinstance(m, (ColumnParallelLinear, MultiQueryPackedLinear)):  # both gather the norm's slices
                    m.sequence_parallel, m.sequence_dim = True, self.dim
                    m.input_copy = self.column_gather(m)
                    self.setup.column_layers.append(self.name_of(m))
                    if id(m) not in adapters:
                        self.setup.handles.append(
                            m.register_forward_pre_hook(_ColumnInputCheck(self.name_of(m), self.name_of(b)))
                        )
            for p in whole_adapter_params(b, row_split=False):
                self.tag(p)
            shape_check = _BlockShapeCheck(self.dim, self.name_of(b))
            self.setup.handles.append(b.register_forward_hook(shape_check, with_kwargs=True))

    def _split_norms(self, b: nn.Module) -> None:
        norms = _norms_of(b)
        if not norms:
            raise _no_norm_error(self.name_of(b), b)
        for _, norm in norms:
            hook = _NormScatter(self.tp_group, self.dim, self.name_of(norm))
            self.setup.handles.append(norm.register_forward_pre_hook(hook.pre))
            self.setup.handles.append(norm.register_forward_hook(hook.post))
            self.setup.split_norms.append(self.name_of(norm))
            for p in norm.parameters():
                self.tag(p)


# ----------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------
def sequence_parallel_grad_params(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of ``module`` (as it is now: after a pipeline cut, this
    stage's) whose gradients must be summed over the TP group before the optimizer step."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for p in module.parameters():
        if id(p) in seen or not p.requires_grad or not getattr(p, SP_PARAM_ATTR, False):
            continue
        seen.add(id(p))
        out.append(p)
    return out


def allreduce_sequence_parallel_grads(params: Iterable[nn.Parameter], tp_group) -> None:
    """Sum the gradients of ``params`` over ``tp_group`` in place, one collective per
    dtype/device. Uses ``param.main_grad`` (the strategy's gradient buffer) where it exists,
    else ``param.grad``; parameters without either are skipped."""
    if group_world_size(tp_group) == 1:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is None:
            continue
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, tp_group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
