"""Token dispatch for mixture-of-experts: send every routed token to the rank holding its expert
and bring the expert outputs back, weighted by the router.

Two dispatchers with one interface (``dispatch`` then ``combine``):

* :class:`AllToAllDispatcher` (default): permute the local tokens by expert, exchange the
  per-expert counts, and move exactly the routed tokens with one uneven ``all_to_all_single``
  over the expert-parallel (EP) group; with expert-tensor parallelism (``etp > 1``) the received
  tokens are then all-gathered over the expert-TP group and the experts' partial outputs
  reduce-scattered back. ``combine`` is the exact inverse. Communication per direction: each
  routed (token, expert) pair once.
* :class:`AllGatherDispatcher`: the simple alternative. Every rank all-gathers all tokens of its
  EP (then expert-TP) group, runs its local experts on the ones routed to them, and the weighted
  partial outputs are reduce-scattered back. Moves ``ep`` times every token instead of ``k``
  copies of it, but needs no count exchange before the data moves.

Every collective here has its conjugate in backward, so both paths are differentiable end to
end. The uneven all-gather / reduce-scatter are built from ``all_to_all_single`` too (gloo's
``all_gather`` refuses tensors of different sizes). gloo, NCCL and MPI all implement
``all_to_all_single`` with uneven splits; for a backend that does not, :func:`all_to_all_v`
falls back (once, with a warning) to one ``isend``/``irecv`` per peer.

Every collective is reported to :func:`megastrategy.layers.mappings.record_collectives` as
``all_to_all`` (EP token exchange), ``all_to_all_counts`` (the count exchange),
``all_gather_v`` / ``reduce_scatter_v`` (uneven expert-TP or token-split traffic) or
``all_gather`` (equal-size count gathers).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megastrategy.collectives import is_unsupported_error
from megastrategy.layers.mappings import ProcessGroupRef, _record, all_gather
from megastrategy.layers.mappings import group_rank as _group_rank
from megastrategy.layers.mappings import group_world_size as _group_world_size

log = logging.getLogger(__name__)

__all__ = [
    "all_to_all_v",
    "gather_v",
    "reduce_scatter_v",
    "split_tokens",
    "gather_tokens",
    "token_split_sizes",
    "narrow_rows",
    "AllToAllDispatcher",
    "AllGatherDispatcher",
    "make_dispatcher",
]

# Set when the backend turned down all_to_all_single; later calls go straight to the fallback.
_A2A_FALLBACK = {"active": False}


def group_world_size(group) -> int:
    """Size of ``group``; 1 for ``None``. (In torch.distributed ``None`` means the world; here it
    means "not parallel": an unsharded MoE layer must not talk to anyone.)"""
    return 1 if group is None else _group_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else _group_rank(group)


# ----------------------------------------------------------------------------------------
# raw (non-autograd) exchanges, all along dim 0
# ----------------------------------------------------------------------------------------
def _exchange(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group, label: str) -> Tensor:
    """Uneven all-to-all along dim 0: rows ``in_splits[j]`` go to peer ``j``; ``out_splits[j]``
    rows come from peer ``j``, concatenated in peer order. Returns a new tensor."""
    world = group_world_size(group)
    x = x.contiguous()
    if world == 1:
        return x.clone()
    out_splits, in_splits = [int(s) for s in out_splits], [int(s) for s in in_splits]
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    _record(label, x)
    if not _A2A_FALLBACK["active"]:
        try:
            dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
            return out
        except (RuntimeError, NotImplementedError) as err:
            if not is_unsupported_error(err):
                raise
            log.warning("all_to_all_single is not supported by this backend (%s); using point-to-point exchange", err)
            _A2A_FALLBACK["active"] = True
    _exchange_p2p(out, x, out_splits, in_splits, group)
    return out


def _exchange_p2p(out: Tensor, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    """Fallback for backends without ``all_to_all_single``: one ``isend``/``irecv`` per peer with
    a non-empty share, all posted together (so no ordering can deadlock), plus a local copy."""
    world, me = group_world_size(group), group_rank(group)
    peers = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    in_off = [0]
    for s in in_splits:
        in_off.append(in_off[-1] + s)
    out_off = [0]
    for s in out_splits:
        out_off.append(out_off[-1] + s)
    ops = []
    for j in range(world):
        if j == me:
            out[out_off[j] : out_off[j + 1]].copy_(x[in_off[j] : in_off[j + 1]])
            continue
        if in_splits[j]:
            ops.append(dist.P2POp(dist.isend, x[in_off[j] : in_off[j + 1]].contiguous(), peers[j], group))
        if out_splits[j]:
            ops.append(dist.P2POp(dist.irecv, out[out_off[j] : out_off[j + 1]], peers[j], group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _gather_v_raw(x: Tensor, sizes: Sequence[int], group) -> Tensor:
    """Concatenate every rank's ``x`` (``sizes[j]`` rows on rank j) along dim 0."""
    world = group_world_size(group)
    if world == 1:
        return x
    n = x.size(0)
    # every peer gets the whole local tensor: an uneven all-gather as an all-to-all
    rep = x.unsqueeze(0).expand(world, *x.shape).reshape(world * n, *x.shape[1:])
    return _exchange(rep, sizes, [n] * world, group, "all_gather_v")


def _reduce_scatter_v_raw(x: Tensor, sizes: Sequence[int], group) -> Tensor:
    """Sum ``x`` (``sum(sizes)`` rows, identical layout on every rank) over the group and keep
    this rank's ``sizes[rank]`` rows."""
    world = group_world_size(group)
    if world == 1:
        return x
    n = int(sizes[group_rank(group)])
    parts = _exchange(x, [n] * world, sizes, group, "reduce_scatter_v")
    return parts.view(world, n, *x.shape[1:]).sum(0)


def _all_gather_counts(t: Tensor, group) -> Tensor:
    """All-gather an equal-size integer tensor; returns ``[world, *t.shape]``."""
    world = group_world_size(group)
    if world == 1:
        return t.unsqueeze(0)
    return all_gather(t.reshape(1, -1), group, dim=0).view(world, *t.shape)


# ----------------------------------------------------------------------------------------
# autograd functions
# ----------------------------------------------------------------------------------------
class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        return _exchange(x, out_splits, in_splits, group, "all_to_all")

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _exchange(g, in_splits, out_splits, ctx.group, "all_to_all"), None, None, None


class _GatherV(torch.autograd.Function):
    """Forward: uneven all-gather of distinct rows; backward: reduce-scatter (every rank's
    consumers contribute to every row)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = list(sizes), group
        return _gather_v_raw(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_v_raw(g, ctx.sizes, ctx.group), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = list(sizes), group
        return _reduce_scatter_v_raw(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_v_raw(g.contiguous(), ctx.sizes, ctx.group), None, None


class _SplitTokens(torch.autograd.Function):
    """Replicated input -> this rank's rows. Backward: all-gather (each rank's rows have their
    own gradient; the replicated input's gradient is all of them)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = list(sizes), group
        r = group_rank(group)
        start = sum(ctx.sizes[:r])
        return x.narrow(0, start, ctx.sizes[r]).contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather_v_raw(g.contiguous(), ctx.sizes, ctx.group), None, None


class _GatherTokens(torch.autograd.Function):
    """Rows of every rank -> replicated tensor. Backward: keep this rank's rows (the gradient of a
    replicated output is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = list(sizes), group
        return _gather_v_raw(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        r = group_rank(ctx.group)
        start = sum(ctx.sizes[:r])
        return g.narrow(0, start, ctx.sizes[r]).contiguous(), None, None


def all_to_all_v(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> Tensor:
    """Differentiable uneven all-to-all along dim 0 (backward: the reverse exchange)."""
    if group_world_size(group) == 1:
        return x
    return _AllToAllV.apply(x, list(out_splits), list(in_splits), group)


def gather_v(x: Tensor, sizes: Sequence[int], group) -> Tensor:
    """Differentiable uneven all-gather of distinct rows (backward: reduce-scatter)."""
    if group_world_size(group) == 1:
        return x
    return _GatherV.apply(x, list(sizes), group)


def reduce_scatter_v(x: Tensor, sizes: Sequence[int], group) -> Tensor:
    """Differentiable uneven reduce-scatter (backward: all-gather)."""
    if group_world_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, list(sizes), group)


def token_split_sizes(n: int, world: int) -> list[int]:
    """How ``n`` replicated rows are split over ``world`` ranks (the first ``n % world`` get one more)."""
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def split_tokens(x: Tensor, group) -> Tensor:
    """This rank's rows of a tensor replicated over ``group`` (backward: all-gather)."""
    world = group_world_size(group)
    if world == 1:
        return x
    return _SplitTokens.apply(x, token_split_sizes(x.size(0), world), group)


def gather_tokens(x: Tensor, n: int, group) -> Tensor:
    """Inverse of :func:`split_tokens` for ``n`` rows in all (backward: keep this rank's rows)."""
    world = group_world_size(group)
    if world == 1:
        return x
    return _GatherTokens.apply(x, token_split_sizes(n, world), group)


def narrow_rows(x: Tensor, group) -> Tensor:
    """Non-differentiable :func:`split_tokens` (routing indices, masks)."""
    world = group_world_size(group)
    if world == 1:
        return x
    sizes = token_split_sizes(x.size(0), world)
    r = group_rank(group)
    return x.narrow(0, sum(sizes[:r]), sizes[r])


# ----------------------------------------------------------------------------------------
# dispatchers
# ----------------------------------------------------------------------------------------
class _Base:
    def __init__(self, num_experts: int, ep_group=None, etp_group=None) -> None:
        self.num_experts = num_experts
        self._ep = ProcessGroupRef(ep_group)
        self._etp = ProcessGroupRef(etp_group)
        # fixed for the dispatcher's life (it is rebuilt when the layer is sharded)
        self.ep_size, self.ep_rank = group_world_size(ep_group), group_rank(ep_group)
        self.etp_size = group_world_size(etp_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.ep_size}")
        self.num_local_experts = num_experts // self.ep_size
        self.local_expert_offset = self.ep_rank * self.num_local_experts

    @property
    def ep_group(self):
        return self._ep.group

    @property
    def etp_group(self):
        return self._etp.group

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep_size}, etp={self.etp_size})"


@dataclass
class _AllToAllState:
    num_tokens: int
    token_of_row: Tensor  # [M] local token index of each sent row (rows sorted by global expert)
    weight_pos: Tensor  # [M] position of each sent row in weights.reshape(-1)
    weights: Tensor  # [N, k] router weights (differentiable)
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: Tensor  # [ep, E_local]: rows received from peer j for local expert e
    etp_sizes: Optional[list[int]]
    expert_order: Tensor  # permutation of received rows into local-expert order
    expert_order_inverse: Tensor


class AllToAllDispatcher(_Base):
    """Uneven all-to-all over EP (+ all-gather / reduce-scatter over expert-TP when etp > 1)."""

    def preprocess(self, indices: Tensor, keep: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        """The static part of dispatch (no collective; no host sync when dropless, so a CUDA graph
        can hold it): assignment positions grouped by expert, their tokens, and per-expert counts."""
        N, k = indices.shape
        flat_e = indices.reshape(-1)
        pos = torch.arange(N * k, device=indices.device)
        if keep is not None:
            pos = keep.reshape(-1).nonzero().squeeze(1)
            flat_e = flat_e[pos]
        order = torch.argsort(flat_e, stable=True)  # group by expert, token order inside
        pos = pos[order]
        token_of_row = torch.div(pos, k, rounding_mode="floor")
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat_e.device).scatter_add_(
            0, flat_e, torch.ones_like(flat_e)
        )
        return pos, token_of_row, counts

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor, keep: Optional[Tensor] = None):
        """Send the rows of ``x`` [N, H] to their experts.

        ``indices``/``weights`` [N, k]: the experts each token is routed to and their router
        weights; ``keep`` [N, k] (bool, optional): assignments that survive the capacity limit.
        Returns ``(expert_input [R, H] sorted by local expert, tokens_per_local_expert, state)``.
        """
        N, k = indices.shape
        ep, E_loc = self.ep_size, self.num_local_experts
        pos, token_of_row, counts = self.preprocess(indices, keep)
        rows = x.index_select(0, token_of_row)
        per_peer = counts.view(ep, E_loc)
        recv_counts = _exchange(per_peer, [1] * ep, [1] * ep, self.ep_group, "all_to_all_counts") if ep > 1 else per_peer
        send_splits = per_peer.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        h = all_to_all_v(rows, recv_splits, send_splits, self.ep_group)
        etp_sizes = None
        blocks = recv_counts  # [sources, E_loc], rows of h in this block order
        if self.etp_size > 1:
            all_counts = _all_gather_counts(recv_counts.reshape(-1), self.etp_group)  # [etp, ep*E_loc]
            etp_sizes = all_counts.sum(1).tolist()
            h = gather_v(h, etp_sizes, self.etp_group)
            blocks = all_counts.view(-1, E_loc)
        row_expert = torch.arange(E_loc, device=h.device).repeat(blocks.size(0)).repeat_interleave(
            blocks.reshape(-1).to(h.device)
        )
        expert_order = torch.argsort(row_expert, stable=True)
        inverse = torch.empty_like(expert_order)
        inverse[expert_order] = torch.arange(expert_order.numel(), device=expert_order.device)
        h = h.index_select(0, expert_order)
        tokens_per_local_expert = blocks.sum(0).tolist()
        state = _AllToAllState(
            N, token_of_row, pos, weights, send_splits, recv_splits, recv_counts, etp_sizes, expert_order, inverse
        )
        return h, tokens_per_local_expert, state

    def combine(self, y: Tensor, state: _AllToAllState, output_bias: Optional[Tensor] = None) -> Tensor:
        """The exact inverse of :meth:`dispatch`: returns ``sum_j weight[t, j] * y(t, expert j)`` [N, H].

        With etp > 1, ``y`` holds partial sums (the row-parallel second layer), reduced here;
        ``output_bias`` [E_local, H] (the experts' second bias, replicated over expert-TP) is then
        added once to every row of the matching expert.
        """
        y = y.index_select(0, state.expert_order_inverse)
        if self.etp_size > 1:
            y = reduce_scatter_v(y, state.etp_sizes, self.etp_group)
            if output_bias is not None:
                mine = torch.arange(self.num_local_experts, device=y.device).repeat(self.ep_size).repeat_interleave(
                    state.recv_counts.reshape(-1).to(y.device)
                )
                y = y + output_bias.index_select(0, mine)
        y = all_to_all_v(y, state.send_splits, state.recv_splits, self.ep_group)
        w = state.weights.reshape(-1).index_select(0, state.weight_pos).to(y.dtype)
        y = y * w.unsqueeze(1)
        return y.new_zeros((state.num_tokens, y.size(1))).index_add(0, state.token_of_row, y)


@dataclass
class _AllGatherState:
    num_tokens: int
    ep_sizes: Optional[list[int]]
    etp_sizes: Optional[list[int]]
    gathered_tokens: int
    token_of_row: Tensor  # [M] gathered-token index of each local-expert row
    weight_pos: Tensor  # [M] position in gathered_weights.reshape(-1)
    gathered_weights: Tensor  # [N_gathered, k]
    ep_indices: Tensor  # [N_ep, k] indices after the EP gather (for the output bias)
    ep_weights: Tensor  # [N_ep, k]
    ep_keep: Optional[Tensor]


class AllGatherDispatcher(_Base):
    """All-gather every token of the EP (then expert-TP) group; reduce-scatter the outputs back."""

    def _gather_all(self, x, indices, weights, keep, group):
        world = group_world_size(group)
        if world == 1:
            return x, indices, weights, keep, None
        sizes = _all_gather_counts(torch.tensor([x.size(0)], device=indices.device), group).reshape(-1).tolist()
        x = gather_v(x, sizes, group)
        weights = gather_v(weights, sizes, group)
        indices = _gather_v_raw(indices, sizes, group)
        if keep is not None:
            keep = _gather_v_raw(keep.to(torch.uint8), sizes, group).bool()
        return x, indices, weights, keep, sizes

    def _local_mask(self, indices: Tensor, keep: Optional[Tensor]) -> Tensor:
        lo = self.local_expert_offset
        mask = (indices >= lo) & (indices < lo + self.num_local_experts)
        return mask & keep if keep is not None else mask

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor, keep: Optional[Tensor] = None):
        N, k = indices.shape
        x1, i1, w1, k1, ep_sizes = self._gather_all(x, indices, weights, keep, self.ep_group)
        x2, i2, w2, k2, etp_sizes = self._gather_all(x1, i1, w1, k1, self.etp_group)
        pos = self._local_mask(i2, k2).reshape(-1).nonzero().squeeze(1)
        e_local = i2.reshape(-1)[pos] - self.local_expert_offset
        order = torch.argsort(e_local, stable=True)
        pos, e_local = pos[order], e_local[order]
        token_of_row = torch.div(pos, k, rounding_mode="floor")
        h = x2.index_select(0, token_of_row)
        tokens_per_local_expert = torch.bincount(e_local, minlength=self.num_local_experts).tolist()
        state = _AllGatherState(N, ep_sizes, etp_sizes, x2.size(0), token_of_row, pos, w2, i1, w1, k1)
        return h, tokens_per_local_expert, state

    def combine(self, y: Tensor, state: _AllGatherState, output_bias: Optional[Tensor] = None) -> Tensor:
        w = state.gathered_weights.reshape(-1).index_select(0, state.weight_pos).to(y.dtype)
        out = y.new_zeros((state.gathered_tokens, y.size(1))).index_add(0, state.token_of_row, y * w.unsqueeze(1))
        if self.etp_size > 1:
            out = reduce_scatter_v(out, state.etp_sizes, self.etp_group)
            if output_bias is not None:
                # sum_j w[t, j] * b[e_j] over this rank's experts, once per token after the reduction
                mask = self._local_mask(state.ep_indices, state.ep_keep)
                local = (state.ep_indices - self.local_expert_offset).clamp(0, self.num_local_experts - 1)
                wl = state.ep_weights.to(out.dtype) * mask.to(out.dtype)  # [N_ep, k]
                out = out + (wl.unsqueeze(-1) * output_bias[local]).sum(1)
        if self.ep_size > 1:
            out = reduce_scatter_v(out, state.ep_sizes, self.ep_group)
        return out


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def make_dispatcher(kind: str, num_experts: int, ep_group=None, etp_group=None):
    try:
        cls = DISPATCHERS[kind]
    except KeyError:
        raise ValueError(f"dispatcher={kind!r}: use one of {sorted(DISPATCHERS)}") from None
    return cls(num_experts, ep_group, etp_group)
