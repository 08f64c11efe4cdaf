"""A ZeRO-1 distributed optimizer over the contiguous gradient buffer.

Every data-parallel rank owns one contiguous shard of each gradient bucket (the buckets of a
:class:`~megastrategy.ddp.grad_buffer.GradientBuffer` built with ``distributed_optimizer=True``
are padded to a multiple of ``dp``). After :meth:`GradientBuffer.reduce` has reduce-scattered the
gradients, only the owned shards hold averaged gradients, and only they are updated here:

* the user's optimizer (whatever ``configure_optimizers`` returned: AdamW, SGD, ...) is rebuilt,
  with the same class, hyperparameters and parameter groups, over fp32 *main weights* of the
  owned pieces only, so its state (Adam's moments, SGD's momentum) takes ``1/dp`` of the memory;
  a parameter that straddles a shard boundary contributes one piece to each owning rank;
* :meth:`DistributedOptimizer.step` updates the owned pieces, then every rank all-gathers the
  updated values of each bucket and copies them into the model's parameters.

With MoE layers the optimizer spans two buffers, each sharded over its own group (the dense one
over the data-parallel ranks, the experts' over the expert-data-parallel ranks): every piece
knows its buffer, and reductions, gathers and the state's collectives run per buffer over that
buffer's group, in the same order on every rank.

Main weights of contiguous fp32 parameters are views of the parameters themselves (updated in
place, no extra memory); other parameters (bf16, fp16, non-contiguous) get fp32 copies.

The object stays a ``torch.optim.Optimizer`` for Lightning: ``param_groups`` IS the user
optimizer's list (same dicts), so LR schedulers created on the user's optimizer keep working and
their changes reach the rebuilt optimizer at every step; ``state_dict()`` returns the ordinary
torch format over the model's parameters (a collective over the data-parallel group: the owned
pieces are gathered), so every checkpoint writer that understands a plain optimizer, including
the resharding DCP checkpoints of :mod:`megastrategy.checkpoint`, works unchanged and a checkpoint
loads on any data-parallel size, with or without the distributed optimizer.
:meth:`DistributedOptimizer.sharded_state_dict` is the communication-free alternative (owned
pieces plus the metadata to reassemble them; :func:`merge_sharded_state_dicts`).

Gradient clipping must use the true global norm: :meth:`DistributedOptimizer.grad_norm` sums
the owned pieces' squares, then over the data-parallel group and over the model-parallel group;
``counts_here`` excludes the copies that must count once (TP-replicated parameters on TP ranks
other than 0, the last pipeline stage's tied embedding), as in :func:`~megastrategy.ddp.grad_clip.global_grad_norm`.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megastrategy.collectives import all_gather_single, try_fused
from megastrategy.ddp.grad_buffer import GradientBuffer, _unsupported
from megastrategy.ddp.param_gather import ParamGather

__all__ = ["DistributedOptimizer", "MainParamsOptimizer", "merge_sharded_state_dicts", "SHARDED_FORMAT", "MAIN_PARAM_KEY"]

SHARDED_FORMAT = "megastrategy-zero1-v1"
#: optimizer-state key of a half-precision parameter's fp32 main copy (saved so a resume is exact)
MAIN_PARAM_KEY = "fp32_main_param"


class _Piece:
    """The part ``[lo, hi)`` of ``param.view(-1)`` this rank owns, its main weight and gradient."""

    __slots__ = ("param", "index", "lo", "hi", "buffer", "bucket", "shard_lo", "main", "is_view", "param_ptr")

    def __init__(self, param: nn.Parameter, index: int, lo: int, hi: int, buffer: GradientBuffer, bucket, shard_lo: int):
        self.param, self.index, self.lo, self.hi = param, index, lo, hi
        self.buffer, self.bucket, self.shard_lo = buffer, bucket, shard_lo  # shard_lo: offset inside this rank's shard
        whole = lo == 0 and hi == param.numel()
        self.param_ptr = param.data_ptr()
        if param.dtype == torch.float32 and param.is_contiguous():
            flat = param.detach().view(-1)[lo:hi]
            self.main = flat.view_as(param) if whole else flat  # updated in place: no copy, no memory
            self.is_view = True
        else:
            flat = param.detach().reshape(-1)[lo:hi].to(torch.float32, copy=True)
            self.main = flat.view_as(param) if whole else flat
            self.is_view = False

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def grad(self) -> Tensor:
        """This piece's reduced gradient: a view into its gradient buffer (main's shape)."""
        start = self.buffer.shard_range(self.bucket)[0] + self.shard_lo
        return self.bucket.data[start : start + self.numel].view(self.main.shape)


def _elementwise(value: Any, like: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape == like.shape


def _portable(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


class DistributedOptimizer(torch.optim.Optimizer):
    """``optimizer`` rebuilt over this rank's shards of its gradient buffers (ZeRO-1).

    Args:
        optimizer: the user's optimizer, as ``configure_optimizers`` returned it (not stepped;
            its ``param_groups`` become this optimizer's ``param_groups``).
        buffers: the gradient buffer (or buffers) holding every parameter of ``optimizer`` that
            requires grad, each built with ``distributed_optimizer=True`` (any buffer when its
            group has one rank). Each buffer is sharded over its own group: with MoE layers the
            dense buffer over the data-parallel ranks, the expert buffer over the
            expert-data-parallel ranks (Megatron's layout), one optimizer over both, so the
            user's parameter groups and LR schedulers span dense and expert parameters alike.

    ``step()`` expects ``buffer.reduce()`` to have run since the last backward; it does nothing
    (but run the closure) when no gradient was accumulated, like a torch optimizer whose
    parameters have no ``.grad``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, buffers: Union[GradientBuffer, Sequence[GradientBuffer]]) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("DistributedOptimizer: the optimizer is already distributed.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        buffers = [buffers] if isinstance(buffers, GradientBuffer) else list(buffers)
        if not buffers:
            raise ValueError("DistributedOptimizer needs at least one gradient buffer.")
        if self._needs_sharded_buffer and any(b.dp_size > 1 and not b.distributed_optimizer for b in buffers):
            raise ValueError(
                "DistributedOptimizer needs a GradientBuffer built with distributed_optimizer=True "
                "(buckets padded to a multiple of the data-parallel size and reduce-scattered)."
            )
        if optimizer.state:
            raise ValueError(
                "DistributedOptimizer: the optimizer already has state; wrap it before its first step "
                "(load a checkpoint with load_state_dict afterwards)."
            )
        self._building = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._building = False
        self.param_groups = optimizer.param_groups  # the SAME list and dicts: schedulers drive us
        self.user_optimizer = optimizer
        self.buffers = buffers
        self._pieces: list[_Piece] = []
        self._group_pieces: list[list[_Piece]] = []
        self._indexed: list[nn.Parameter] = []  # the flat parameter list torch's state_dict numbers
        # (buffer position, bucket index) -> [(index, param)]
        self._in_buffer: dict[tuple[int, int], list[tuple[int, nn.Parameter]]] = {}
        for group in self.param_groups:
            self._group_pieces.append(self._add_params(group["params"]))
        inner_groups = [
            {**self._hyper(group), "params": [piece.main for piece in pieces]}
            for group, pieces in zip(self.param_groups, self._group_pieces)
        ]
        self.shard_optimizer = self._rebuild(type(optimizer), inner_groups, optimizer.defaults)
        self.param_gathers: dict[int, ParamGather] = {}  # buffer position -> its overlapped gathers

    _needs_sharded_buffer = True

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer, under the name Lightning reads for a wrapped one (DeepSpeed's
        ``.optimizer``): ``LearningRateMonitor`` then logs ``lr-AdamW`` as under DDP and sees that
        the user's scheduler drives it, instead of adding an ``lr-DistributedOptimizer`` column."""
        return self.user_optimizer

    @property
    def buffer(self) -> GradientBuffer:
        """The first (dense) gradient buffer."""
        return self.buffers[0]

    @property
    def param_gather(self) -> Optional[ParamGather]:
        """The first buffer's overlapped parameter gathers (``overlap_param_gather``), if any."""
        return next(iter(self.param_gathers.values()), None)

    @staticmethod
    def is_sharded(buffer: GradientBuffer) -> bool:
        """Whether the ranks of ``buffer``'s group own different slices (else each owns everything)."""
        return buffer.distributed_optimizer and buffer.dp_size > 1

    @property
    def _sharded(self) -> bool:
        return any(self.is_sharded(b) for b in self.buffers)

    def grad_device(self) -> torch.device:
        """Where the gradients live (for norms computed on ranks without parameters too)."""
        return next((b.params[0].main_grad.device for b in self.buffers if b.params), torch.device("cpu"))

    def _buffer_of(self, p: nn.Parameter) -> Optional[int]:
        return next((i for i, b in enumerate(self.buffers) if id(p) in b._bucket_of), None)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _hyper(group: dict) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    @staticmethod
    def _rebuild(cls: type, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
        try:
            return cls(groups, **defaults)
        except TypeError as first:
            try:
                return cls(groups)
            except TypeError:
                raise TypeError(
                    f"DistributedOptimizer cannot rebuild {cls.__name__} over the owned shards: "
                    f"{cls.__name__}(param_groups, **defaults) failed with {first}. Its constructor must "
                    "accept parameter groups and its `defaults` as keyword arguments (every torch.optim "
                    "optimizer does)."
                ) from first

    def _add_params(self, params: Iterable[nn.Parameter]) -> list[_Piece]:
        pieces: list[_Piece] = []
        for p in params:
            index = len(self._indexed)
            self._indexed.append(p)
            position = self._buffer_of(p)
            if position is None:
                if p.requires_grad:
                    raise ValueError(
                        f"DistributedOptimizer: a parameter of shape {tuple(p.shape)} is in the optimizer but "
                        "not in the gradient buffer (the buffer is built from the module's trainable "
                        "parameters when training starts)."
                    )
                continue  # frozen: never has a gradient, never updated (as in torch)
            buffer = self.buffers[position]
            bucket = buffer.bucket_of(p)
            self._in_buffer.setdefault((position, bucket.index), []).append((index, p))
            start, end = bucket.ranges[id(p)]
            s0, s1 = buffer.shard_range(bucket)
            lo, hi = max(start, s0), min(end, s1)
            if lo < hi:
                pieces.append(_Piece(p, index, lo - start, hi - start, buffer, bucket, lo - s0))
        self._pieces.extend(pieces)
        return pieces

    def add_param_group(self, param_group: dict) -> None:
        if self.__dict__.get("_building", True):
            return super().add_param_group(param_group)  # torch's constructor registering the groups
        super().add_param_group(param_group)  # checks, defaults; appends to the shared list
        group = self.param_groups[-1]
        pieces = self._add_params(group["params"])
        self._group_pieces.append(pieces)
        self.shard_optimizer.add_param_group({**self._hyper(group), "params": [piece.main for piece in pieces]})

    # ------------------------------------------------------------------ torch.optim.Optimizer surface
    @property
    def state(self):  # type: ignore[override]
        """The rebuilt optimizer's state, keyed by main-weight pieces (what Lightning moves to device)."""
        inner = self.__dict__.get("shard_optimizer")
        return inner.state if inner is not None else self.__dict__.get("_initial_state", {})

    @state.setter
    def state(self, value) -> None:
        inner = self.__dict__.get("shard_optimizer")
        if inner is None:
            self.__dict__["_initial_state"] = value  # torch's constructor
        else:
            inner.state = value

    @property
    def dp_group(self):
        return self.buffer.group

    def _sync_hyperparameters(self) -> None:
        inner = self.shard_optimizer.param_groups
        if len(inner) != len(self.param_groups):
            raise RuntimeError(
                f"DistributedOptimizer: {len(self.param_groups)} parameter groups but {len(inner)} rebuilt; "
                "add groups through this optimizer's add_param_group."
            )
        for outer, group in zip(self.param_groups, inner):
            for key, value in outer.items():
                if key != "params":
                    group[key] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the buffer (cleared by ``buffer.zero()``); drop any ``.grad`` left."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()
        for piece in self._pieces:
            piece.main.grad = None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.user_optimizer._opt_called = True  # what torch's LR schedulers check on the user's optimizer
        self.wait_for_param_gather()  # a parameter no forward used may still be pending
        stepped = [b for b in self.buffers if b.has_grads]
        if not stepped:
            return loss  # no backward since the last zero() (or a skipped step): nothing to apply
        if not all(b.is_reduced for b in stepped):
            raise RuntimeError(
                "DistributedOptimizer.step(): the gradients have not been reduced; call buffer.reduce() "
                "after the last backward and before step()."
            )
        self._sync_hyperparameters()
        for piece in self._pieces:
            if piece.is_view and piece.param.data_ptr() != piece.param_ptr:
                raise RuntimeError(
                    "DistributedOptimizer: a parameter's storage was replaced (param.data = ... or a device "
                    "move) after the optimizer was built; rebuild the optimizer."
                )
            if piece.buffer.has_grads:  # a buffer without gradients: its parameters are skipped, as in torch
                grad = piece.grad()
                piece.main.grad = grad if grad.dtype == torch.float32 else grad.float()
        self.shard_optimizer.step()
        for piece in self._pieces:
            piece.main.grad = None
        self._gather_params()
        return loss

    # ------------------------------------------------------------------ parameters
    def _buckets(self) -> list[tuple[int, Any]]:
        """``(buffer position, bucket)`` of every bucket holding parameters of this optimizer, in
        the same order on every rank."""
        return [(position, self.buffers[position].buckets[i]) for position, i in sorted(self._in_buffer)]

    def _pieces_in(self, bucket) -> list[_Piece]:
        return [piece for piece in self._pieces if piece.bucket is bucket]

    def _all_gather(self, buffer: GradientBuffer, shard: Tensor, numel: int) -> Tensor:
        """Concatenate every rank's ``shard`` (equal sizes) over ``buffer``'s group into one flat tensor."""
        if not self.is_sharded(buffer):
            return shard
        full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        done, _ = try_fused("all_gather", all_gather_single, _unsupported, full, shard, group=buffer.group)
        if done:
            return full
        dist.all_gather(list(full.chunk(buffer.dp_size)), shard, group=buffer.group)
        return full

    def _gather_params(self) -> None:
        """Every rank's updated pieces into every rank's parameters, one all-gather per bucket over
        its buffer's group (with :meth:`enable_overlap_param_gather`: started here, finished before each use)."""
        for position, bucket in reversed(self._buckets()):  # the first layers' bucket (needed first) first
            buffer, gather = self.buffers[position], self.param_gathers.get(position)
            if gather is not None:
                gather.start(bucket.index, self._owned_shard(buffer, bucket), bucket.numel(), buffer.dp_size)
            else:
                full = self._all_gather(buffer, self._owned_shard(buffer, bucket), bucket.numel())
                self._copy_into_params(position, bucket.index, full)

    def _owned_shard(self, buffer: GradientBuffer, bucket) -> Tensor:
        """This rank's shard of ``bucket`` of ``buffer`` holding its updated main weights (zeros in padding)."""
        s0, s1 = buffer.shard_range(bucket)
        shard = torch.zeros(s1 - s0, dtype=bucket.data.dtype, device=bucket.data.device)
        for piece in self._pieces_in(bucket):
            shard[piece.shard_lo : piece.shard_lo + piece.numel].copy_(piece.main.reshape(-1))
        return shard

    def _copy_into_params(self, position: int, index: int, full: Tensor) -> None:
        bucket = self.buffers[position].buckets[index]
        for _, p in self._in_buffer[(position, index)]:
            start, end = bucket.ranges[id(p)]
            p.detach().copy_(full[start:end].view(p.shape))

    def enable_overlap_param_gather(self, module: nn.Module) -> None:
        """Gather parameters in the background after each step; ``module``'s submodules wait for
        their buckets in a forward pre-hook (see :mod:`megastrategy.ddp.param_gather`). One
        :class:`ParamGather` per sharded buffer, over that buffer's group."""
        for position, buffer in enumerate(self.buffers):
            if not self.is_sharded(buffer):
                continue  # nothing is gathered
            bucket_of = {id(p): index for (pos, index), members in self._in_buffer.items() if pos == position
                         for _, p in members}
            self.param_gathers[position] = ParamGather(buffer.group, partial(self._copy_into_params, position), _unsupported)
            self.param_gathers[position].attach(module, bucket_of)

    def detach_param_gathers(self) -> None:
        """Remove the forward pre-hooks of :meth:`enable_overlap_param_gather` (at teardown)."""
        for gather in self.param_gathers.values():
            gather.detach()

    def wait_for_param_gather(self) -> None:
        """Finish pending background gathers (before anything reads every parameter)."""
        for gather in self.param_gathers.values():
            gather.wait_all()

    @property
    def has_main_copies(self) -> bool:
        """Whether some parameter's main weight is a copy (half precision, non-contiguous), which a
        write to the parameter outside the optimizer does not reach."""
        return any(not piece.is_view for piece in self._pieces)

    def reload_main_params(self, params: Optional[Iterable[Tensor]] = None) -> None:
        """Copy the model's current parameters (all, or ``params``) into the fp32 main copies (after
        changing the parameters outside the optimizer, e.g. loading weights into the module in place)."""
        self.wait_for_param_gather()  # or a late gather would overwrite the loaded weights
        only = None if params is None else {id(p) for p in params}
        with torch.no_grad():
            for piece in self._pieces:
                if not piece.is_view and (only is None or id(piece.param) in only):
                    piece.main.copy_(piece.param.detach().reshape(-1)[piece.lo : piece.hi].view(piece.main.shape))

    # ------------------------------------------------------------------ clipping
    def local_grad_norm(self, buffer: GradientBuffer, counts: Callable[[nn.Parameter], bool], norm_type: float) -> Tensor:
        """``sum |g|^p`` (``max |g|`` for ``p = inf``) of this rank's owned pieces of ``buffer``
        whose parameter ``counts``: the local term of a global norm. No communication."""
        local = torch.zeros((), dtype=torch.float32, device=self.grad_device())
        for piece in self._pieces:
            if piece.buffer is buffer and counts(piece.param):
                g = piece.grad().detach().float()
                local = torch.maximum(local, g.abs().max()) if norm_type == math.inf else local + g.norm(norm_type) ** norm_type
        return local

    def grad_norm(
        self,
        *,
        counts_here: Optional[Callable[[nn.Parameter], bool]] = None,
        model_parallel_group: Optional[dist.ProcessGroup] = None,
        norm_type: float = 2.0,
        buffer: Optional[GradientBuffer] = None,
    ) -> Tensor:
        """The norm of the whole model's gradient from the owned shards of ``buffer`` (collective).

        Sums ``|g|^p`` of the owned pieces whose parameter ``counts_here``, over the buffer's
        group, then over ``model_parallel_group`` (tensor x pipeline ranks). With several buffers
        (MoE) each is reduced over other groups: name the one meant; the caller combines them
        (:func:`megastrategy.moe.integration.distributed_grad_norm_with_experts`).
        """
        if buffer is None:
            if len(self.buffers) > 1:
                raise ValueError("DistributedOptimizer.grad_norm over several gradient buffers: pass buffer=...; "
                                 "with MoE layers use megastrategy.moe.integration.distributed_grad_norm_with_experts.")
            buffer = self.buffer
        norm_type = float(norm_type)
        local = self.local_grad_norm(buffer, counts_here or (lambda p: True), norm_type)
        groups = [g for g in (buffer.group if self.is_sharded(buffer) else None, model_parallel_group) if g is not None]
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        if dist.is_initialized():
            for group in groups:
                dist.all_reduce(local, op=op, group=group)
        return local if norm_type == math.inf else local ** (1.0 / norm_type)

    def scale_grads_(self, coef: Tensor) -> None:
        """Multiply every owned gradient by ``coef`` (a clipping coefficient)."""
        for piece in self._pieces:
            g = piece.grad()
            g.mul_(coef.to(g.device, g.dtype))

    def clip_grad_norm_(
        self,
        max_norm: float,
        *,
        counts_here: Optional[Callable[[nn.Parameter], bool]] = None,
        model_parallel_group: Optional[dist.ProcessGroup] = None,
        norm_type: float = 2.0,
    ) -> Tensor:
        """Scale the owned gradients so that the global norm is at most ``max_norm``; returns the
        norm before clipping (same formula as :func:`torch.nn.utils.clip_grad_norm_`)."""
        total = self.grad_norm(counts_here=counts_here, model_parallel_group=model_parallel_group, norm_type=norm_type)
        self.scale_grads_((float(max_norm) / (total + 1e-6)).clamp(max=1.0))
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the owned gradients to ``[-clip_value, clip_value]`` (elementwise: no communication)."""
        for piece in self._pieces:
            piece.grad().clamp_(-float(clip_value), float(clip_value))

    # ------------------------------------------------------------------ state
    def _torch_groups(self) -> list[dict]:
        groups, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**self._hyper(group), "params": list(range(start, start + n))})
            start += n
        return groups

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The torch-format state over the model's parameters, whole (collective over each
        buffer's group: DP for dense parameters, expert-DP for experts).

        Exactly what the user's optimizer would return had it been stepped on every rank: state
        tensors have their parameter's shape, ``param_groups`` number the parameters in order.
        """
        self.wait_for_param_gather()
        self._sync_hyperparameters()
        inner_state = self._state_with_main_params()
        objects, elementwise = self._state_records(inner_state)
        state: dict[int, dict[str, Any]] = {}
        for index in sorted(set(objects) | set(elementwise)):
            state[index] = dict(objects.get(index, {}))
        for position, bucket in self._buckets():  # the same buckets and keys in the same order on every rank
            buffer = self.buffers[position]
            members = [(i, p) for i, p in self._in_buffer[(position, bucket.index)] if i in elementwise]
            keys = sorted({(k, dt) for i, _ in members for k, dt in elementwise[i].items()}, key=lambda kd: (kd[0], str(kd[1])))
            s0, s1 = buffer.shard_range(bucket)
            for key, dtype in keys:
                shard = torch.zeros(s1 - s0, dtype=dtype, device=bucket.data.device)
                for piece in self._pieces_in(bucket):
                    value = inner_state.get(piece.main, {}).get(key)
                    if _elementwise(value, piece.main):
                        shard[piece.shard_lo : piece.shard_lo + piece.numel].copy_(value.reshape(-1))
                full = self._all_gather(buffer, shard, bucket.numel())
                for i, p in members:
                    if key in elementwise[i]:
                        start, end = bucket.ranges[id(p)]
                        state[i][key] = full[start:end].view(p.shape).clone()
        return {"state": state, "param_groups": self._torch_groups()}

    def _state_records(self, inner_state: dict) -> tuple[dict, dict]:
        """Per parameter index: its non-elementwise state values (e.g. Adam's step, from the rank
        owning the parameter's first element) and its elementwise keys with their dtypes, as every
        rank of each buffer's group knows them (one ``all_gather_object`` per sharded buffer)."""
        objects: dict[int, dict[str, Any]] = {}
        elementwise: dict[int, dict[str, torch.dtype]] = {}
        for buffer in self.buffers:
            objs: dict[int, dict[str, Any]] = {}
            elems: dict[int, dict[str, torch.dtype]] = {}
            for piece in self._pieces:
                if piece.buffer is not buffer:
                    continue
                for key, value in inner_state.get(piece.main, {}).items():
                    if _elementwise(value, piece.main):
                        elems.setdefault(piece.index, {})[key] = value.dtype
                    elif piece.lo == 0:
                        objs.setdefault(piece.index, {})[key] = _portable(value)
            everyone: list[Any] = [(objs, elems)]
            if self.is_sharded(buffer):
                everyone = [None] * buffer.dp_size
                dist.all_gather_object(everyone, (objs, elems), group=buffer.group)
            for rank_objs, rank_elems in everyone:
                for index, values in rank_objs.items():
                    objects.setdefault(index, {}).update(values)
                for index, keys in rank_elems.items():
                    elementwise.setdefault(index, {}).update(keys)
        return objects, elementwise

    def _state_with_main_params(self) -> dict:
        """The rebuilt optimizer's state plus each fp32 main copy of a half-precision parameter,
        so that a checkpoint keeps the precision the parameters themselves do not have."""
        state = dict(self.shard_optimizer.state)
        for piece in self._pieces:
            if not piece.is_view:
                state[piece.main] = {**state.get(piece.main, {}), MAIN_PARAM_KEY: piece.main.detach()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a torch-format state (from :meth:`state_dict`, or from the user's optimizer on any
        number of ranks): each rank keeps its pieces. No communication (beyond pending gathers)."""
        self.wait_for_param_gather()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved_groups)} parameter groups, the optimizer {len(self.param_groups)}."
            )
        saved_index: dict[int, Any] = {}  # our flat index -> the saved state's key
        position = 0
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"a parameter group has {len(saved['params'])} parameters in the optimizer state, "
                    f"{len(group['params'])} in the optimizer."
                )
            for key in saved["params"]:
                saved_index[position] = key
                position += 1
        saved_state = state_dict.get("state", {})
        by_int = {int(k): v for k, v in saved_state.items()}
        inner_state: dict[int, dict[str, Any]] = {}
        inner_position = 0
        for pieces in self._group_pieces:
            for piece in pieces:
                values = by_int.get(int(saved_index[piece.index]))
                if values:
                    out: dict[str, Any] = {}
                    for key, value in values.items():
                        if key == MAIN_PARAM_KEY:  # not optimizer state: the main copy itself
                            if not piece.is_view:
                                main = value.reshape(-1)[piece.lo : piece.hi].reshape(piece.main.shape)
                                piece.main.detach().copy_(main)
                            continue
                        if _elementwise(value, piece.param):
                            out[key] = value.reshape(-1)[piece.lo : piece.hi].reshape(piece.main.shape).clone()
                        elif isinstance(value, Tensor):
                            out[key] = value.clone()  # pieces must not share e.g. Adam's step counter
                        else:
                            out[key] = value
                    inner_state[inner_position] = out
                inner_position += 1
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})  # in place: schedulers see it
        inner_groups = []
        start = 0
        for group, pieces in zip(self.param_groups, self._group_pieces):
            inner_groups.append({**self._hyper(group), "params": list(range(start, start + len(pieces)))})
            start += len(pieces)
        self.shard_optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces of the state and the metadata to reassemble them (no communication).

        ``merge_sharded_state_dicts([every rank's sharded_state_dict()])`` is :meth:`state_dict`;
        :meth:`load_sharded_state_dict` loads such a list on any data-parallel size. One buffer
        only: with MoE layers the expert pieces are spread over other ranks (expert-DP) than the
        dense ones, so there is no single set of shards to merge; use :meth:`state_dict`.
        """
        if len(self.buffers) > 1:
            raise ValueError(
                f"DistributedOptimizer.sharded_state_dict() over {len(self.buffers)} gradient buffers (dense and "
                "expert parameters, sharded over different groups): the pieces of one parameter are not on the "
                "same ranks for every buffer. Use state_dict() (a collective over each buffer's group), as the "
                "strategy's checkpoints do."
            )
        self._sync_hyperparameters()
        inner_state = self._state_with_main_params()
        return {
            "format": SHARDED_FORMAT,
            "dp_rank": self.buffer.dp_rank if self._sharded else 0,
            "dp_size": self.buffer.dp_size if self._sharded else 1,
            "param_groups": self._torch_groups(),
            "params": {
                i: tuple(p.shape) for members in self._in_buffer.values() for i, p in members
            },
            "pieces": [
                {
                    "index": piece.index,
                    "lo": piece.lo,
                    "hi": piece.hi,
                    "state": {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in inner_state.get(piece.main, {}).items()},
                }
                for piece in self._pieces
            ],
        }

    def load_sharded_state_dict(self, shards: Sequence[dict[str, Any]]) -> None:
        """Load every rank's :meth:`sharded_state_dict` (saved on any data-parallel size)."""
        self.load_state_dict(merge_sharded_state_dicts(shards))


def merge_sharded_state_dicts(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The torch-format optimizer state from all ranks' :meth:`DistributedOptimizer.sharded_state_dict`."""
    if not shards:
        raise ValueError("merge_sharded_state_dicts needs the shards of every data-parallel rank")
    for shard in shards:
        if shard.get("format") != SHARDED_FORMAT:
            raise ValueError(f"not a {SHARDED_FORMAT} optimizer shard: format={shard.get('format')!r}")
    sizes = {shard["dp_size"] for shard in shards}
    ranks = sorted(shard["dp_rank"] for shard in shards)
    if len(sizes) != 1 or ranks != list(range(next(iter(sizes)))):
        raise ValueError(f"need one shard per data-parallel rank; got ranks {ranks} of sizes {sorted(sizes)}")
    shapes = shards[0]["params"]
    state: dict[int, dict[str, Any]] = {}
    filled: dict[tuple[int, str], int] = {}
    for shard in shards:
        for piece in shard["pieces"]:
            index, lo, hi = piece["index"], piece["lo"], piece["hi"]
            numel = math.prod(shapes[index])
            entry = state.setdefault(index, {})
            for key, value in piece["state"].items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == hi - lo:
                    full = entry.get(key)
                    if full is None:
                        full = entry[key] = torch.zeros(numel, dtype=value.dtype, device=value.device)
                    full[lo:hi] = value.reshape(-1)
                    filled[(index, key)] = filled.get((index, key), 0) + hi - lo
                elif lo == 0:
                    entry[key] = value
    for (index, key), count in filled.items():
        shape = shapes[index]
        if count != math.prod(shape):
            raise ValueError(f"optimizer state {key!r} of parameter #{index}: the shards cover {count} of {math.prod(shape)} elements")
        state[index][key] = state[index][key].view(shape)
    return {"state": state, "param_groups": [dict(g) for g in shards[0]["param_groups"]]}


class MainParamsOptimizer(DistributedOptimizer):
    """fp32 main weights for half-precision parameters, without sharding (``bf16-true``/``16-true``).

    Updating bf16 parameters directly loses every update smaller than their precision (about
    1/256 of the weight), so long runs stall. Like Megatron's float16 optimizer, this keeps an
    fp32 main copy of each half-precision parameter, steps the user's optimizer on the copies
    with the fp32 gradients of the buffer, and copies the result back into the parameters.
    Every data-parallel rank owns everything (the buffer is all-reduced, not reduce-scattered),
    so nothing is gathered; fp32 parameters are updated in place as before.
    """

    _needs_sharded_buffer = False

    def _gather_params(self) -> None:
        """Each rank updated whole parameters: copy the main weights back, nothing to gather."""
        for piece in self._pieces:
            if not piece.is_view:  # fp32 parameters were updated in place
                piece.param.detach().copy_(piece.main.view_as(piece.param))
