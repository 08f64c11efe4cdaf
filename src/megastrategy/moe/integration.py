"""What ``MegatronStrategy`` calls to run ``MoELayer``s expert-parallel.

Gradient bookkeeping (why the functions below do what they do)
---------------------------------------------------------------
Dense parameters (attention, norms, embeddings, the MoE *router*) are replicated over the dense
data-parallel group (size ``dp = world/(tp·pp)``) and reduced by the ordinary
:class:`~megastrategy.ddp.grad_buffer.GradientBuffer`: sum over ``dp_group``, divide by ``dp``,
which matches DDP's average of the per-replica losses.

Expert parameters are different. Inside one EP group every token of every replica in that group
reaches its expert exactly once (tokens replicated over TP are split over TP before dispatch), so
a local expert's gradient is already the *sum* over those replicas. The expert-data-parallel group
(``edp = world/(etp·ep·pp)``) holds the copies of the same expert shard that saw the other
replicas' tokens. Summing over ``expert_dp_group`` therefore gives the sum over all ``dp``
replicas, and dividing by the dense ``dp`` (not by ``edp``) gives DDP's average:
:class:`ExpertGradientBuffer` does exactly ``main_grad /= dp; all_reduce(SUM, expert_dp_group)``
— it divides even when ``edp == 1``.

Clipping counts each gradient once: dense parameters as before (TP-replicated ones on TP rank 0,
norm² summed over the model-parallel group ``tp-pp``); expert parameters on every rank except
copies replicated over expert-TP (the second bias when ``etp > 1``), which count on expert-TP
rank 0; their norm² is summed over the whole world and divided by ``edp`` (the world holds
``edp`` identical copies of every expert shard). See :func:`clip_grad_norm_with_experts`.

With the distributed optimizer (ZeRO-1) the expert buffer is reduce-scattered over
``expert_dp_group`` like the dense one over ``dp_group``: each edp rank owns, updates and
all-gathers ``1/edp`` of the expert gradients and optimizer state. The norm then comes from the
owned pieces (:func:`distributed_grad_norm_with_experts`): each expert element is owned by one
rank of its edp group, so the world sum counts it once without the division.

The auxiliary losses' gradient is injected in backward, multiplied by each layer's
``aux_loss_scale``; :func:`set_aux_loss_scale` must be given the factor the main loss is
multiplied by before its backward: ``1/accumulate_grad_batches`` and, under pipeline
parallelism, a further ``1/num_microbatches`` (times the GradScaler's scale with fp16 loss
scaling).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megastrategy.ddp.grad_buffer import DEFAULT_BUCKET_NUMEL, GradientBuffer
from megastrategy.ddp.grad_clip import global_grad_norm
from megastrategy.divisors import divisors
from megastrategy.errors import MegatronConfigError
from megastrategy.moe.experts import get_expert_info, is_expert_parameter
from megastrategy.moe.hf_experts import fused_experts, shard_fused_experts, validate_fused_experts
from megastrategy.moe.layer import MoELayer
from megastrategy.moe.unsplit_experts import refuse_unsplit_experts

__all__ = [
    "moe_layers",
    "validate_moe",
    "shard_moe_layers",
    "expert_parameters",
    "dense_parameters",
    "is_expert_parameter",
    "ExpertGradientBuffer",
    "make_expert_grad_buffer",
    "set_aux_loss_scale",
    "aux_loss_scale",
    "collect_aux_losses",
    "expert_grad_counts_here",
    "clip_grad_norm_with_experts",
    "grad_norm_with_experts",
    "distributed_grad_norm_with_experts",
]


def moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def validate_moe(module: nn.Module, layout) -> None:
    """Raise :class:`MegatronConfigError` if the MoE layers cannot be split over ``layout``
    (a :class:`~megastrategy.parallel_state.ParallelLayout`). Pure: no collectives.

    ``world % (etp·ep·pp)`` is already checked by the layout itself.
    """
    validate_fused_experts(module, layout)
    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, MoELayer)]
    # ep/etp without any MoE layer are harmless (the expert grid is simply unused), unless the
    # model declares experts we would leave whole
    refuse_unsplit_experts(module, layout.ep, bool(layers) or next(fused_experts(module), None) is not None)
    for name, m in layers:
        if m.num_experts % layout.ep:
            raise MegatronConfigError(
                f"ep={layout.ep}: MoE layer {name!r} has num_experts={m.num_experts}, which is not divisible by ep "
                f"(every expert-parallel rank holds num_experts/ep whole experts). Valid ep for this model: "
                f"{divisors(m.num_experts)} (also dividing the world size {layout.world_size} with etp·pp)."
            )
        if m.ffn_hidden_size % layout.etp:
            raise MegatronConfigError(
                f"etp={layout.etp}: MoE layer {name!r} has ffn_hidden_size={m.ffn_hidden_size}, which is not divisible "
                f"by etp (each expert's FFN is split column/row-wise over the expert-tensor-parallel ranks). Valid etp: "
                f"{divisors(m.ffn_hidden_size)}; pass etp explicitly (it defaults to tp)."
            )


def shard_moe_layers(module: nn.Module, parallel_state) -> int:
    """Make every ``MoELayer`` (and every Hugging Face fused-experts module, :mod:`.hf_experts`)
    of ``module`` expert-parallel in place.

    Each layer keeps only this rank's experts (its expert-TP slice of each), copied from the
    one-device weights it holds now — call it after every rank holds the same weights (after the
    strategy's broadcast) and before the gradient buffers and optimizers are built. Layers that
    are already sharded are left alone. Collective: every rank must call it; returns the number
    of MoE layers summed over all ranks (the same on every rank; > 0 iff any rank has one), so
    that every rank can take the same MoE/no-MoE code path later.
    """
    ps = parallel_state
    layers = moe_layers(module)
    for m in layers:
        if not m.sharded:
            m.shard(ep_group=ps.ep_group, etp_group=ps.expert_tp_group, tp_group=ps.tp_group)
    total = len(layers) + shard_fused_experts(module, ps)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if dist.get_backend() == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([total], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        total = int(t.item())
    return total


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts (reduced over ``expert_dp_group``), without duplicates."""
    seen, out = set(), []
    for p in module.parameters():
        if is_expert_parameter(p) and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def dense_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (reduced over the dense ``dp_group``; includes the routers)."""
    seen, out = set(), []
    for p in module.parameters():
        if not is_expert_parameter(p) and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class ExpertGradientBuffer(GradientBuffer):
    """A :class:`GradientBuffer` over ``expert_dp_group`` whose result is the *sum* over that group
    divided by the *dense* data-parallel size (see the module docstring).

    The base class averages over its group (divides by ``edp`` when ``edp > 1``, not at all when
    ``edp == 1``); :meth:`reduce` then multiplies by ``scale = edp / dp`` (``1 / dp`` when
    ``edp == 1``). Scaling after the reduction keeps every option of the base class
    (overlapped or reduce-scattered buckets) untouched. Equivalent, and cleaner, would be a
    ``gradient_scaling_factor=1/dp`` option in the base class replacing its ``1/group size``
    (Megatron's ``expert_gradient_scaling_factor``), applied even for a group of size 1.
    """

    def __init__(self, params: Iterable[nn.Parameter], *, expert_dp_group, dense_dp_size: int, **kwargs) -> None:
        super().__init__(params, group=expert_dp_group, **kwargs)
        self.dense_dp_size = int(dense_dp_size)
        self.scale = self.dp_size / self.dense_dp_size

    def reduce(self) -> None:
        super().reduce()
        if self.scale != 1.0:
            for flat in self.buffers.values():
                flat.mul_(self.scale)


def make_expert_grad_buffer(
    module_or_params,
    parallel_state,
    *,
    grad_reduce_in_fp32: bool = True,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    **buffer_kwargs,
) -> ExpertGradientBuffer:
    """The expert gradient buffer for ``module`` (or an iterable of expert parameters), reduced
    over ``parallel_state.expert_dp_group`` and scaled to the dense ``dp`` average.
    ``buffer_kwargs`` go to :class:`GradientBuffer` (e.g. ``overlap_grad_reduce=True``)."""
    params = expert_parameters(module_or_params) if isinstance(module_or_params, nn.Module) else list(module_or_params)
    return ExpertGradientBuffer(
        params,
        expert_dp_group=parallel_state.expert_dp_group,
        dense_dp_size=parallel_state.dp_size,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        bucket_numel=bucket_numel,
        **buffer_kwargs,
    )


# ---------------------------------------------------------------------------------------------
# auxiliary losses
# ---------------------------------------------------------------------------------------------
def aux_loss_scale(accumulate_grad_batches: int = 1, num_microbatches: int = 1, loss_scale: float = 1.0) -> float:
    """The factor the main loss is multiplied by before backward, hence the aux gradient's."""
    return float(loss_scale) / (accumulate_grad_batches * num_microbatches)


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Set the multiplier of the auxiliary losses' injected gradient on every MoE layer."""
    for m in moe_layers(module):
        m.aux_loss_scale = float(scale)


def collect_aux_losses(
    module: nn.Module,
    group=None,
    *,
    kind: str = "aux",
    device: Optional[torch.device] = None,
) -> Optional[torch.Tensor]:
    """Mean over MoE layers of the auxiliary loss (``kind="aux"``: load balancing, including its
    coefficient; ``"z"``: z-loss) recorded by the training forwards since the last call (each
    layer's value averaged over those forwards first); clears the records.

    Without ``group``, only this rank's layers count, and a rank without MoE layers returns None.
    With ``group`` (under pipeline parallelism: the ``pp_group``), every rank of the group must
    call it — also ranks without MoE layers, which contribute nothing — and all get the mean over
    all the group's layers (or all None): no rank waits for another that skipped the call.
    """
    total, count = None, 0
    for m in moe_layers(module):
        v = m.pop_recorded(kind)
        if v is not None:
            total = v if total is None else total + v
            count += 1
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if device is None:
            device = total.device if total is not None else next(
                (p.device for p in module.parameters()), torch.device("cpu")
            )
        t = torch.zeros(2, dtype=torch.float64, device=device)
        if total is not None:
            t[0] = total.double()
            t[1] = count
        dist.all_reduce(t, group=group)
        if t[1].item() == 0:
            return None
        return (t[0] / t[1]).float()
    if total is None:
        return None
    return total / count


# ---------------------------------------------------------------------------------------------
# clipping
# ---------------------------------------------------------------------------------------------
def expert_grad_counts_here(p: nn.Parameter, parallel_state) -> bool:
    """Whether this rank adds expert parameter ``p`` to the (world-summed) expert norm."""
    info = get_expert_info(p)
    return info is not None and (not info.etp_replicated or parallel_state.expert_tp_rank == 0)


def clip_grad_norm_with_experts(
    params: Iterable[nn.Parameter],
    max_norm: float,
    *,
    parallel_state,
    dense_counts_here: Callable[[nn.Parameter], bool],
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip by the true global norm of a model with dense and expert parameters.

    ``dense_counts_here`` is the strategy's existing rule for dense parameters (reduced over
    ``mp_group``). Collective over the whole world: every rank must call it (also ranks without
    expert parameters) whenever *any* rank has MoE layers. Returns the norm before clipping.
    """
    params = [p for p in params if p.grad is not None]
    total = grad_norm_with_experts(params, parallel_state=parallel_state, dense_counts_here=dense_counts_here,
                                   norm_type=norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total


def grad_norm_with_experts(
    params: Iterable[nn.Parameter],
    *,
    parallel_state,
    dense_counts_here: Callable[[nn.Parameter], bool],
    norm_type: float = 2.0,
) -> torch.Tensor:
    """The true global norm of dense and expert gradients (collective over the whole world, as
    :func:`clip_grad_norm_with_experts`)."""
    ps = parallel_state
    params = [p for p in params if p.grad is not None]
    dense = [p for p in params if not is_expert_parameter(p)]
    experts = [p for p in params if expert_grad_counts_here(p, ps)]
    dense_norm = global_grad_norm(dense, counts_here=dense_counts_here, group=ps.mp_group, norm_type=norm_type)
    device = dense_norm.device
    if experts:
        device = experts[0].grad.device
    inf = norm_type == float("inf")
    local = torch.zeros((), dtype=torch.float32, device=device)
    for p in experts:
        g = p.grad.detach().float()
        local = torch.maximum(local, g.abs().max()) if inf else local + g.norm(norm_type) ** norm_type
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        if not inf:
            local = local / ps.layout.edp
    dense_norm = dense_norm.to(device)
    if inf:
        total = torch.maximum(dense_norm, local)
    else:
        total = (dense_norm.float() ** norm_type + local) ** (1.0 / norm_type)
    return total


def distributed_grad_norm_with_experts(
    optimizer,
    *,
    parallel_state,
    dense_counts_here: Callable[[nn.Parameter], bool],
    norm_type: float = 2.0,
) -> torch.Tensor:
    """The true global norm of dense and expert gradients from a
    :class:`~megastrategy.ddp.distributed_optimizer.DistributedOptimizer` over the dense and the
    expert buffers (ZeRO-1, or bf16-true main weights): dense pieces as without MoE (over each
    buffer's group, then ``mp_group``); expert pieces summed over the whole world, divided by
    ``edp`` only when their buffer is not sharded (then every edp rank holds the whole shard).
    Collective over the whole world, as :func:`grad_norm_with_experts`."""
    ps, norm_type = parallel_state, float(norm_type)
    inf = norm_type == float("inf")
    experts = [b for b in optimizer.buffers if isinstance(b, ExpertGradientBuffer)]
    dense = [optimizer.grad_norm(counts_here=dense_counts_here, model_parallel_group=ps.mp_group, norm_type=norm_type,
                                 buffer=b) for b in optimizer.buffers if not isinstance(b, ExpertGradientBuffer)]
    local = torch.zeros((), dtype=torch.float32, device=optimizer.grad_device())
    for b in experts:
        part = optimizer.local_grad_norm(b, lambda p: expert_grad_counts_here(p, ps), norm_type)
        local = torch.maximum(local, part) if inf else local + (part if optimizer.is_sharded(b) else part / ps.layout.edp)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    terms = [n.to(local.device).float() for n in dense]
    if inf:
        return torch.stack([local, *terms]).max()
    return (local + sum(t ** norm_type for t in terms)) ** (1.0 / norm_type)
