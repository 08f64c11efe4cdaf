"""Cross entropy (and argmax) over logits whose vocab dimension is split over TP ranks.

Each rank holds the columns ``[vocab_start, vocab_start + local)`` of the (padded)
vocabulary. Columns with a global id ``>= vocab_size`` are padding and never take part.
Only per-token statistics cross ranks, so communication is O(tokens), never
O(tokens x vocab):

1. the global max of each row (all-reduce MAX), for numerical stability;
2. one fused all-reduce SUM of [target logit, sum of exp (, sum of logits for label
   smoothing)] per token.

Backward computes ``softmax - onehot`` on the local columns with no communication.
Semantics follow ``torch.nn.functional.cross_entropy`` with class-index targets and no
class weights: ``ignore_index``, ``reduction`` in mean/sum/none (mean over non-ignored
targets) and ``label_smoothing`` (uniform over the real vocab).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megastrategy.layers.mappings import all_gather, all_reduce, group_world_size

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_argmax"]

_REDUCTIONS = ("mean", "sum", "none")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _plain(t: Tensor) -> Tensor:
    if type(t) is not Tensor and isinstance(t, Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return t.as_subclass(Tensor)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, ignore_index, reduction,
                label_smoothing):
        local_vocab = logits.size(-1)
        lead_shape = logits.shape[:-1]
        n_real = max(0, min(local_vocab, vocab_size - vocab_start))  # non-padding local columns
        cdtype = _compute_dtype(logits.dtype)
        x = logits.reshape(-1, local_vocab)[:, :n_real]
        t = target.reshape(-1).long()
        n_tok = x.size(0)
        if t.numel() != n_tok:
            raise ValueError(
                f"cross entropy: target has {t.numel()} elements but the logits have {n_tok} rows "
                f"(logits {tuple(lead_shape)} + vocab, target {tuple(target.shape)})"
            )

        # 1. global row max
        if n_real > 0:
            row_max = x.amax(dim=-1).to(cdtype)
        else:
            row_max = torch.full((n_tok,), float("-inf"), dtype=cdtype, device=logits.device)
        all_reduce(row_max, group, op="max")

        shifted = x.to(cdtype) - row_max.unsqueeze(-1)  # new tensor [n_tok, n_real]

        # 2. per-token statistics, one fused all-reduce
        valid = t != ignore_index
        in_shard = valid & (t >= vocab_start) & (t < vocab_start + n_real)
        local_t = torch.where(in_shard, t - vocab_start, torch.zeros_like(t))
        stats = torch.zeros((3 if label_smoothing > 0 else 2, n_tok), dtype=cdtype, device=logits.device)
        if n_real > 0:
            tgt = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1)
            stats[0] = torch.where(in_shard, tgt, torch.zeros_like(tgt))
            if label_smoothing > 0:
                stats[2] = shifted.sum(dim=-1)
            exp = shifted.exp_()  # reuse the buffer
            stats[1] = exp.sum(dim=-1)
        else:
            exp = shifted
        all_reduce(stats, group, op="sum")
        target_logit, sum_exp = stats[0], stats[1]

        log_z = torch.log(sum_exp)
        loss = log_z - target_logit
        if label_smoothing > 0:
            smooth = log_z - stats[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss = torch.where(valid, loss, torch.zeros_like(loss))

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        count = valid.sum()
        ctx.save_for_backward(softmax, local_t, in_shard, valid, count)
        ctx.meta = (lead_shape, local_vocab, n_real, vocab_size, reduction, label_smoothing,
                    logits.dtype)

        if reduction == "none":
            out = loss.view(lead_shape)
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.sum() / count
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        softmax, local_t, in_shard, valid, count = ctx.saved_tensors
        lead_shape, local_vocab, n_real, vocab_size, reduction, eps, in_dtype = ctx.meta
        cdtype = softmax.dtype
        n_tok = softmax.size(0)
        if reduction == "none":
            scale = grad_out.reshape(-1).to(cdtype)
        elif reduction == "sum":
            scale = grad_out.to(cdtype).expand(n_tok)
        else:
            scale = (grad_out.to(cdtype) / count).expand(n_tok)
        scale = torch.where(valid, scale, torch.zeros_like(scale))  # also kills 0/0 of empty mean

        grad = softmax * scale.unsqueeze(-1)
        if n_real > 0:
            onehot_w = (-(1.0 - eps) * scale * in_shard).unsqueeze(-1)
            grad.scatter_add_(1, local_t.unsqueeze(1), onehot_w)
            if eps > 0:
                grad.sub_((eps / vocab_size) * scale.unsqueeze(-1))
        if n_real < local_vocab:
            grad = torch.nn.functional.pad(grad, (0, local_vocab - n_real))
        grad = grad.view(*lead_shape, local_vocab).to(in_dtype)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    target: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross entropy of logits split over the vocab (last) dim across ``group``.

    ``local_logits`` [..., local_vocab] holds global vocab ids
    ``[vocab_start, vocab_start + local_vocab)``; ids ``>= vocab_size`` are padding.
    ``target`` [...] holds class indices (identical on every rank of ``group``).
    Returns what ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ...)`` would
    (shape ``target.shape`` for ``reduction="none"``), in the logits' dtype (float32 under
    autocast, as autocast does for cross entropy); the math runs in float32 for half/bfloat16
    logits. Targets outside ``[0, vocab_size)`` that are
    not ``ignore_index`` are not checked (that would need a host sync).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: must be one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: must be within [0, 1]")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(
            "vocab_parallel_cross_entropy takes class-index targets (an integer tensor); "
            f"got {target.dtype}"
        )
    local_logits = _plain(local_logits)
    target = _plain(target)
    if torch.is_autocast_enabled(local_logits.device.type) and local_logits.dtype != torch.float32:
        # Autocast runs cross entropy in float32 (its output too); do what F.cross_entropy would.
        local_logits = local_logits.float()
    return _VocabParallelCrossEntropy.apply(
        local_logits, target, int(vocab_start), int(vocab_size), group, int(ignore_index),
        reduction, float(label_smoothing),
    )


def vocab_parallel_argmax(
    local_logits: Tensor, *, vocab_start: int, vocab_size: int, group, keepdim: bool = False
) -> Tensor:
    """Global argmax over the vocab (last) dim of logits split over ``group``.

    Returns int64 global ids (first occurrence of the max, like ``torch.argmax``); each
    rank exchanges only its per-token (max, index): O(tokens x tp) elements.
    """
    local_logits = _plain(local_logits).detach()
    local_vocab = local_logits.size(-1)
    n_real = max(0, min(local_vocab, vocab_size - vocab_start))
    lead_shape = local_logits.shape[:-1]
    x = local_logits.reshape(-1, local_vocab)[:, :n_real]
    n_tok = x.size(0)
    if n_real > 0:
        vals, idx = x.max(dim=-1)
        vals = vals.to(torch.float64)
        idx = (idx + vocab_start).to(torch.float64)
    else:
        vals = torch.full((n_tok,), float("-inf"), dtype=torch.float64, device=x.device)
        idx = torch.zeros((n_tok,), dtype=torch.float64, device=x.device)
    if group_world_size(group) > 1:
        both = all_gather(torch.stack([vals, idx]).unsqueeze(0), group, dim=0)  # [tp, 2, n_tok]
        all_vals, all_idx = both[:, 0], both[:, 1]
        # NaN counts as the maximum, as in torch.argmax
        all_vals = torch.where(torch.isnan(all_vals), torch.full_like(all_vals, float("inf")), all_vals)
        best = all_vals.argmax(dim=0, keepdim=True)  # first rank holding the max = smallest id
        idx = all_idx.gather(0, best).squeeze(0)
    out = idx.to(torch.int64).view(lead_shape)
    return out.unsqueeze(-1) if keepdim else out
