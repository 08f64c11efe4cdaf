"""Tensor-parallel drop-in for ``torch.nn.MultiheadAttention``.

Megatron's attention split: the packed input projection ``in_proj_weight`` ``[3h, h]`` is
column-parallel, so TP rank ``r`` holds ``[q_r | k_r | v_r]`` -- the projections of heads
``r*h/tp ... (r+1)*h/tp - 1`` -- and computes attention for those heads only; the output
projection is row-parallel and its all-reduce re-assembles the full ``[.., h]`` output.
Nothing but that one all-reduce (and its conjugate on the input gradient) crosses ranks,
unless the caller asks for the attention weights.

The module keeps ``nn.MultiheadAttention``'s call signature, return values and mask
semantics, so ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` /
``nn.TransformerEncoder`` run it unchanged. Their fused inference fast paths, which would
call the full-size native kernels with this rank's shards, are declined (see
:attr:`TensorParallelMultiheadAttention.in_proj_weight`).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear
from megastrategy.layers.mappings import (
    ProcessGroupRef,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_world_size,
    reduce_from_tensor_parallel_region,
)
from megastrategy.layers.random import ModelParallelRNGTracker

__all__ = ["TensorParallelMultiheadAttention"]


class _FastPathGuard(Tensor):
    """A plain tensor subclass: its only job is to make ``has_torch_function`` true.

    ``nn.TransformerEncoder.forward`` decides whether to convert its input to a nested
    tensor (its inference "sparsity fast path") without looking at
    ``_qkv_same_embed_dim``/``in_proj_bias`` again -- it only builds a tuple of the first
    layer's weights and declines when any of them "has a torch function". Exposing
    ``in_proj_weight`` as this type therefore keeps nested tensors away from the
    tensor-parallel layers, whatever ``enable_nested_tensor`` the encoder was built with.
    """


def _canonical_mask(mask: Tensor | None, name: str, dtype: torch.dtype) -> Tensor | None:
    """bool (True = masked) -> additive float mask; float masks pass through (as MHA)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise AssertionError(f"only bool and floating types of {name} are supported")
    return mask if mask.dtype == dtype else mask.to(dtype)


class TensorParallelMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` over the local ``num_heads / tp`` heads of one TP rank.

    Build it with :meth:`from_module` from the user's ``nn.MultiheadAttention`` (its
    weights are sliced, never re-initialized), or directly (fresh parameters initialized by
    the parallel linear layers).

    Sub-modules: ``in_proj`` (:class:`ColumnParallelLinear`, ``packed_chunks=3``, local
    weight ``[3h/tp, h]`` laid out ``[q_r|k_r|v_r]``) and ``out_proj``
    (:class:`RowParallelLinear`, ``input_is_parallel=True``).

    Attributes kept from ``nn.MultiheadAttention`` (full, unsharded sizes): ``embed_dim``,
    ``kdim``, ``vdim``, ``num_heads``, ``head_dim``, ``dropout`` (the attention-probability
    dropout ``p``), ``batch_first``, ``bias_k``/``bias_v`` (``None``), ``add_zero_attn``
    (``False``). Local sizes: ``num_local_heads``, ``local_embed_dim``, ``tp_rank``,
    ``tp_size``.

    Fast-path guards (read by ``torch/nn/modules/transformer.py``): ``in_proj_bias`` is
    ``None`` and ``_qkv_same_embed_dim`` is ``False`` -- ``TransformerEncoderLayer``'s fused
    path and ``TransformerEncoder.__init__``'s nested-tensor switch bail out on them --
    and :attr:`in_proj_weight` is a guard-typed view that makes
    ``TransformerEncoder.forward`` skip the nested-tensor conversion. The real bias is
    ``in_proj.bias``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        group: Any,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        rng_tracker: ModelParallelRNGTracker | None = None,
        input_copy: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp_size = group_world_size(group)
        _check_config(embed_dim=embed_dim, num_heads=num_heads, tp_size=tp_size)
        in_proj = ColumnParallelLinear(
            embed_dim,
            3 * embed_dim,
            group=group,
            bias=bias,
            gather_output=False,
            packed_chunks=3,
            input_copy=input_copy,
            device=device,
            dtype=dtype,
        )
        out_proj = RowParallelLinear(
            embed_dim, embed_dim, group=group, bias=bias, input_is_parallel=True, device=device, dtype=dtype
        )
        self._setup(
            embed_dim=embed_dim,
            num_heads=num_heads,
            group=group,
            dropout=dropout,
            batch_first=batch_first,
            rng_tracker=rng_tracker,
            input_copy=input_copy,
            in_proj=in_proj,
            out_proj=out_proj,
        )

    def _setup(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        group: Any,
        dropout: float,
        batch_first: bool,
        rng_tracker: ModelParallelRNGTracker | None,
        input_copy: Any,
        in_proj: nn.Module,
        out_proj: nn.Module,
    ) -> None:
        tp_size = group_world_size(group)
        self._group_ref = ProcessGroupRef(group)  # deepcopy keeps the same group
        self.tp_size = tp_size
        self.tp_rank = group_rank(group)
        self.embed_dim = embed_dim
        self.kdim = embed_dim
        self.vdim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.num_local_heads = num_heads // tp_size
        self.local_embed_dim = self.num_local_heads * self.head_dim
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.bias_k = None
        self.bias_v = None
        self.add_zero_attn = False
        # fast-path guards, see the class docstring
        self._qkv_same_embed_dim = False
        self.in_proj_bias = None
        self.rng_tracker = rng_tracker
        self.input_copy = input_copy
        self.in_proj = in_proj
        self.out_proj = out_proj

    # ------------------------------------------------------------------------ conversion
    @classmethod
    def from_module(
        cls,
        mha: nn.MultiheadAttention,
        *,
        group: Any,
        rng_tracker: ModelParallelRNGTracker | None = None,
        input_copy: Any = None,
    ) -> "TensorParallelMultiheadAttention":
        """Shard the user's ``nn.MultiheadAttention`` over ``group`` (weights copied, not re-initialized).

        ``rng_tracker``: the attention-probability dropout acts on the local heads, so it
        runs on the tracker's per-TP-rank stream (without a tracker it uses the default
        stream, i.e. the same masks on every TP rank for different heads).
        ``input_copy``: a ``SharedInputCopy`` to share the input-gradient all-reduce with
        other column-parallel consumers of the same input.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(
                f"TensorParallelMultiheadAttention.from_module expects an nn.MultiheadAttention, got {type(mha).__name__}"
            )
        if isinstance(mha, TensorParallelMultiheadAttention):  # pragma: no cover - not an MHA subclass
            return mha
        tp_size = group_world_size(group)
        _check_config(
            embed_dim=mha.embed_dim,
            num_heads=mha.num_heads,
            tp_size=tp_size,
            kdim=mha.kdim,
            vdim=mha.vdim,
            qkv_same=mha._qkv_same_embed_dim,
            add_bias_kv=mha.bias_k is not None or mha.bias_v is not None,
            add_zero_attn=mha.add_zero_attn,
        )
        in_proj, out_proj = _sharded_projections(mha, group, input_copy)
        if mha.dropout > 0 and rng_tracker is None and tp_size > 1:
            warnings.warn(
                f"TensorParallelMultiheadAttention.from_module: dropout={mha.dropout} on the attention "
                "probabilities of the local heads but rng_tracker=None; every TP rank will draw the same "
                "masks for its (different) heads. Pass the strategy's ModelParallelRNGTracker.",
                stacklevel=2,
            )
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._setup(
            embed_dim=mha.embed_dim,
            num_heads=mha.num_heads,
            group=group,
            dropout=mha.dropout,
            batch_first=mha.batch_first,
            rng_tracker=rng_tracker,
            input_copy=input_copy,
            in_proj=in_proj,
            out_proj=out_proj,
        )
        module.train(mha.training)
        return module

    # ----------------------------------------------------------------------- attributes
    @property
    def group(self) -> Any:
        """The tensor-parallel process group."""
        return self._group_ref.group

    @property
    def in_proj_weight(self) -> Tensor:
        """This rank's packed ``[q_r|k_r|v_r]`` weight ``[3h/tp, h]``, as a guard-typed view.

        It shares storage with ``in_proj.weight`` (in-place edits under ``no_grad``, e.g.
        ``nn.init``, reach the parameter) but is detached and typed so that torch's fused
        transformer paths decline it. Optimize/inspect ``in_proj.weight`` instead.
        """
        return self.in_proj.weight.detach().as_subclass(_FastPathGuard)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads} ({self.num_local_heads} local, "
            f"tp={self.tp_size}, rank={self.tp_rank}), dropout={self.dropout}, batch_first={self.batch_first}"
        )

    # -------------------------------------------------------------------------- forward
    def _input_copier(self) -> Callable[[Tensor], Tensor]:
        """Identity forward / all-reduce backward, one per distinct input tensor."""
        if self.input_copy is not None:
            return self.input_copy
        seen: dict[int, tuple[Tensor, Tensor]] = {}

        def copy(x: Tensor) -> Tensor:
            hit = seen.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
            out = copy_to_tensor_parallel_region(x, self.group)
            seen[id(x)] = (x, out)
            return out

        return copy

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Local q, k, v ``[.., h/tp]`` each (column-parallel; input grads all-reduced)."""
        if query is key and key is value:
            qkv = self.in_proj(query)
            if isinstance(qkv, tuple):  # skip_bias_add style return
                raise RuntimeError("TensorParallelMultiheadAttention needs in_proj with skip_bias_add=False")
            return qkv.chunk(3, dim=-1)
        weight = self.in_proj.weight
        bias = self.in_proj.bias
        w_q, w_k, w_v = weight.chunk(3, dim=0)
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
        copy = self._input_copier()
        q = F.linear(copy(query), w_q, b_q)
        if key is value:
            w_kv = weight[self.local_embed_dim :]
            b_kv = bias[self.local_embed_dim :] if bias is not None else None
            k, v = F.linear(copy(key), w_kv, b_kv).chunk(2, dim=-1)
        else:
            k = F.linear(copy(key), w_k, b_k)
            v = F.linear(copy(value), w_v, b_v)
        return q, k, v

    def _local_heads_of_3d_mask(self, mask: Tensor, bsz: int, tgt_len: int, src_len: int) -> Tensor:
        expected = (bsz * self.num_heads, tgt_len, src_len)
        if tuple(mask.shape) != expected:
            raise RuntimeError(f"The shape of the 3D attn_mask is {tuple(mask.shape)}, but should be {expected}.")
        lo = self.tp_rank * self.num_local_heads
        return mask.view(bsz, self.num_heads, tgt_len, src_len)[:, lo : lo + self.num_local_heads]

    def _dropout_context(self):
        if self.rng_tracker is not None:
            return self.rng_tracker.fork()
        return contextlib.nullcontext()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Same arguments, semantics and return values as ``nn.MultiheadAttention.forward``.

        ``attn_output`` is complete (replicated over TP). ``attn_weights`` (only when
        ``need_weights``) are gathered over TP: head-averaged ``[N, L, S]`` or per head
        ``[N, num_heads, L, S]``; they cost an extra collective, so layers that do not use
        them should pass ``need_weights=False`` (the ``nn.Transformer*Layer``s do).
        """
        if query.is_nested or key.is_nested or value.is_nested:
            raise RuntimeError(
                "TensorParallelMultiheadAttention does not accept nested tensors; pass padded "
                "tensors with a key_padding_mask"
            )
        is_batched = _shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads, self.embed_dim)
        key_padding_mask, attn_mask, is_causal = _normalize_masks(
            key_padding_mask, attn_mask, query.dtype, need_weights, is_causal
        )
        layout = _Layout.of(query, key, is_batched, self.batch_first)
        key_padding_mask = layout.batched_padding_mask(key_padding_mask)

        q, k, v = self._project(query, key, value)
        q = self._heads(q, layout, layout.tgt_len)
        k, v = self._heads(k, layout, layout.src_len), self._heads(v, layout, layout.src_len)
        mask = self._combined_mask(attn_mask, key_padding_mask, layout, q.dtype)
        context, weights = self._attend(q, k, v, mask, need_weights, average_attn_weights, is_causal)
        if weights is not None and not is_batched:
            weights = weights.squeeze(0)

        # [N, local heads, L, head_dim] -> input layout with the local features last
        context = context.transpose(1, 2).reshape(layout.bsz, layout.tgt_len, self.local_embed_dim)
        if layout.batch_dim is None:
            context = context.squeeze(0)
        elif layout.batch_dim == 1:
            context = context.transpose(0, 1)
        out = self.out_proj(context)
        if isinstance(out, tuple):
            raise RuntimeError("TensorParallelMultiheadAttention needs out_proj with skip_bias_add=False")
        return out, weights

    def _heads(self, x: Tensor, layout: "_Layout", length: int) -> Tensor:
        """A projection in the input layout -> ``[N, local heads, length, head_dim]``."""
        if layout.batch_dim is None:
            x = x.unsqueeze(0)
        elif layout.batch_dim == 1:
            x = x.transpose(0, 1)
        return x.reshape(layout.bsz, length, self.num_local_heads, self.head_dim).transpose(1, 2)

    def _combined_mask(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, layout: "_Layout", dtype: torch.dtype
    ) -> Tensor | None:
        """One additive mask ``[N or 1, local heads or 1, L, S]`` from the attention and padding masks."""
        tgt_len, src_len = layout.tgt_len, layout.src_len
        mask = None
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (tgt_len, src_len):
                    raise RuntimeError(
                        f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, but should be {(tgt_len, src_len)}."
                    )
                mask = attn_mask.view(1, 1, tgt_len, src_len)
            else:
                mask = self._local_heads_of_3d_mask(attn_mask, layout.bsz, tgt_len, src_len)
        if key_padding_mask is not None:
            kpm = key_padding_mask.view(layout.bsz, 1, 1, src_len)
            mask = kpm if mask is None else mask + kpm
        if mask is not None and mask.dtype != dtype:  # e.g. q in bf16 under autocast
            mask = mask.to(dtype)
        return mask

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, need_weights: bool, average: bool, is_causal: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of the local heads; the weights (gathered over TP) only when asked for."""
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q * math.sqrt(1.0 / float(self.head_dim))) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            probs = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                with self._dropout_context():
                    probs = F.dropout(probs, p=dropout_p, training=True)
            return probs @ v, self._gather_weights(probs, average)
        if dropout_p > 0.0:
            with self._dropout_context():
                return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal), None
        return F.scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal), None

    def _gather_weights(self, probs: Tensor, average: bool) -> Tensor:
        """Local per-head probabilities ``[N, H/tp, L, S]`` -> complete weights (differentiable)."""
        if average:
            partial = probs.sum(dim=1)
            if self.tp_size > 1:
                partial = reduce_from_tensor_parallel_region(partial, self.group)
            return partial / self.num_heads
        if self.tp_size == 1:
            return probs
        gathered = gather_from_tensor_parallel_region(probs.movedim(1, -1).contiguous(), self.group)
        return gathered.movedim(-1, 1)


def _sharded_projections(mha: nn.MultiheadAttention, group: Any, input_copy: Any) -> tuple[nn.Module, nn.Module]:
    """The packed q/k/v projection split by heads (column) and the output projection (row)."""
    in_proj = ColumnParallelLinear.from_weight(
        mha.in_proj_weight,
        mha.in_proj_bias,
        group=group,
        gather_output=False,
        packed_chunks=3,
        input_copy=input_copy,
    )
    out_proj = RowParallelLinear.from_weight(
        mha.out_proj.weight,
        mha.out_proj.bias,
        group=group,
        input_is_parallel=True,
    )
    return in_proj, out_proj


def _normalize_masks(
    key_padding_mask: Tensor | None, attn_mask: Tensor | None, dtype: torch.dtype, need_weights: bool, is_causal: bool
) -> tuple[Tensor | None, Tensor | None, bool]:
    """Float masks as ``nn.MultiheadAttention`` makes them, and whether the causal hint still holds."""
    key_padding_mask = _canonical_mask(key_padding_mask, "key_padding_mask", dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # the hint alone drives scaled_dot_product_attention
    else:
        attn_mask = _canonical_mask(attn_mask, "attn_mask", dtype)
        if key_padding_mask is not None:
            is_causal = False  # merged with the padding mask, no longer causal
    return key_padding_mask, attn_mask, is_causal


class _Layout(NamedTuple):
    """Where the batch sits in the inputs (``None``: unbatched) and the sizes read from them."""

    batch_dim: int | None
    bsz: int
    tgt_len: int
    src_len: int

    @classmethod
    def of(cls, query: Tensor, key: Tensor, is_batched: bool, batch_first: bool) -> "_Layout":
        if not is_batched:
            batch_dim, seq_dim = None, 0
        elif batch_first:
            batch_dim, seq_dim = 0, 1
        else:
            batch_dim, seq_dim = 1, 0
        bsz = query.shape[batch_dim] if batch_dim is not None else 1
        return cls(batch_dim, bsz, query.shape[seq_dim], key.shape[seq_dim])

    def batched_padding_mask(self, key_padding_mask: Tensor | None) -> Tensor | None:
        """``key_padding_mask`` as ``[N, S]`` (checked), ``None`` stays ``None``."""
        if key_padding_mask is None:
            return None
        kpm = key_padding_mask if self.batch_dim is not None else key_padding_mask.unsqueeze(0)
        if tuple(kpm.shape) != (self.bsz, self.src_len):
            raise AssertionError(
                f"Expected key_padding_mask of shape {(self.bsz, self.src_len)} (batch, source length), "
                f"got {tuple(kpm.shape)}"
            )
        return kpm


def _check_config(
    *,
    embed_dim: int,
    num_heads: int,
    tp_size: int,
    kdim: int | None = None,
    vdim: int | None = None,
    qkv_same: bool = True,
    add_bias_kv: bool = False,
    add_zero_attn: bool = False,
) -> None:
    replicate_hint = (
        'or keep it whole by mapping the attention module to "replicate" in tp_plan '
        '(e.g. tp_plan={"<path>.self_attn": "replicate"})'
    )
    if num_heads % tp_size != 0:
        options = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise MegatronConfigError(
            f"nn.MultiheadAttention num_heads={num_heads} is not divisible by tensor_model_parallel_size={tp_size}: "
            f"each TP rank must hold whole heads. Use a tp size that divides num_heads ({options}), "
            + replicate_hint
            + "."
        )
    if embed_dim % num_heads != 0:
        raise MegatronConfigError(
            f"nn.MultiheadAttention embed_dim={embed_dim} is not divisible by num_heads={num_heads}."
        )
    if not qkv_same or (kdim is not None and kdim != embed_dim) or (vdim is not None and vdim != embed_dim):
        raise MegatronConfigError(
            f"nn.MultiheadAttention with kdim={kdim}, vdim={vdim} different from embed_dim={embed_dim} "
            "is not supported by tensor-parallel attention (it needs the packed in_proj_weight). "
            "Build it with kdim=vdim=embed_dim (project keys/values beforehand), " + replicate_hint + "."
        )
    if add_bias_kv:
        raise MegatronConfigError(
            "nn.MultiheadAttention with add_bias_kv=True is not supported by tensor-parallel attention. "
            "Build it with add_bias_kv=False, " + replicate_hint + "."
        )
    if add_zero_attn:
        raise MegatronConfigError(
            "nn.MultiheadAttention with add_zero_attn=True is not supported by tensor-parallel attention. "
            "Build it with add_zero_attn=False, " + replicate_hint + "."
        )


def _shape_check(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    num_heads: int,
    embed_dim: int,
) -> bool:
    """Mirror of ``nn.MultiheadAttention``'s input checks; returns whether the input is batched."""
    if query.dim() == 3:
        if key.dim() != 3 or value.dim() != 3:
            raise AssertionError(
                "For batched (3-D) `query`, expected `key` and `value` to be 3-D"
                f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != 2:
            raise AssertionError(
                "For batched (3-D) `query`, expected `key_padding_mask` to be `None` or 2-D"
                f" but found {key_padding_mask.dim()}-D tensor instead"
            )
        is_batched = True
    elif query.dim() == 2:
        if key.dim() != 2 or value.dim() != 2:
            raise AssertionError(
                "For unbatched (2-D) `query`, expected `key` and `value` to be 2-D"
                f" but found {key.dim()}-D and {value.dim()}-D tensors respectively"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != 1:
            raise AssertionError(
                "For unbatched (2-D) `query`, expected `key_padding_mask` to be `None` or 1-D"
                f" but found {key_padding_mask.dim()}-D tensor instead"
            )
        is_batched = False
    else:
        raise AssertionError(
            f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor"
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise AssertionError(
            f"expected `attn_mask` to be `None`, 2-D or 3-D but found {attn_mask.dim()}-D tensor instead"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.shape[-1] != embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {embed_dim} for {name}, but got {t.shape[-1]}")
    if key.shape != value.shape:
        raise AssertionError(f"key shape {tuple(key.shape)} does not match value shape {tuple(value.shape)}")
    return is_batched
