"""Verify, once in setup, that every sharded block computes what its unsharded original does.

A plan can be shape-consistent and still wrong: a projection declared ``colwise`` whose
output the forward slices by full-size offsets, a per-head norm whose gradient is left
partial, a packed weight split along the wrong boundary. Nothing would fail; training would
silently differ from one device. So, before the first step, each representative block
(:mod:`megastrategy.layers.block_capture`) runs forward and backward on the same random
input twice, unsharded (a copy) and sharded (on the tensor-parallel group), and its output,
its input gradients and its parameter gradients are compared (sharded parameters by the
norm of their gradient summed over the ranks). A mismatch on any rank refuses to train on
every rank, naming the block.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.block_capture import SEED, CapturedBlock
from megastrategy.layers.mappings import all_reduce
from megastrategy.layers.plan.module_names import globify
from megastrategy.rank_zero import log_on_rank_zero

_log = logging.getLogger(__name__)

__all__ = ["verify_sharded_blocks", "block_mismatch", "TOLERANCE", "tolerance_for"]

#: largest accepted max-abs error relative to the reference's largest magnitude (fp32 sums in
#: another order differ by ~1e-6; a wrong plan by ~1)
TOLERANCE = 1e-3
#: the same for 16-bit parameters (``bf16-true``): their rounding alone reaches ~1e-2
HALF_TOLERANCE = 5e-2


def tolerance_for(dtype: torch.dtype) -> float:
    return HALF_TOLERANCE if dtype in (torch.float16, torch.bfloat16) else TOLERANCE


def _float_leaves(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree] if tree.is_floating_point() else []
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in _float_leaves(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _float_leaves(x)]
    return []


def _hidden_input(args: tuple, kwargs: dict) -> tuple[tuple, dict, Tensor]:
    """A copy of the inputs whose hidden states (the first floating tensor, positionally, else as
    ``hidden_states``, else the first floating keyword: FSMT's ``query=``, Pegasus-X's) require grad.
    Other floating inputs (rotary tables, masks) are computed from buffers in the model and carry no
    gradient, so they are treated as constants."""
    args, kwargs = list(args), dict(kwargs)
    for i, a in enumerate(args):
        if _floating(a):
            args[i] = leaf = a.detach().clone().requires_grad_(True)
            return tuple(args), kwargs, leaf
    floating = [k for k, v in kwargs.items() if _floating(v)]
    key = "hidden_states" if "hidden_states" in floating else floating[0] if floating else None
    if key is None:
        raise ValueError("the block received no floating-point tensor to take as its hidden states")
    leaf = kwargs[key] = kwargs[key].detach().clone().requires_grad_(True)
    return tuple(args), kwargs, leaf


def _floating(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def _forward_backward(block: nn.Module, cap: CapturedBlock):
    """Main output, input gradients and parameter gradients of ``block`` on the captured input
    (eval mode; ``autograd.grad``, so no ``.grad`` is touched)."""
    args, kwargs, hidden = _hidden_input(cap.args, cap.kwargs)
    leaves = [hidden]
    out = _float_leaves(block(*args, **kwargs))[0]
    gen = torch.Generator().manual_seed(SEED + 1)
    weight = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
    params = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * weight).sum(), leaves + [p for _, p in params], allow_unused=True)
    return out.detach(), grads[: len(leaves)], dict(zip([n for n, _ in params], grads[len(leaves):]))


def _rel_err(got: Tensor | None, want: Tensor | None, floor: float) -> float:
    """Max-abs error over the reference's magnitude, at least ``floor`` (a gradient that is
    zero in exact arithmetic, as a key bias's, is compared at the block's scale)."""
    if got is None or want is None:
        return 0.0 if got is None and want is None or (want is not None and not want.abs().max() > 0) else 1.0
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / max(float(want.abs().max()), floor, 1e-12))


def _scale(grads) -> float:
    """1% of the largest reference gradient: the floor for comparing tiny gradients."""
    return 1e-2 * max((float(g.abs().max()) for g in grads if g is not None), default=0.0)


def _param_errors(
    ref: dict[str, Tensor | None], got: dict[str, Tensor | None], group, floor: float
) -> list[tuple[str, float]]:
    """Same-shape (replicated) gradients compared directly; sharded ones by their norm over TP.
    Every rank reaches the same collectives in the same order. A parameter the sharded block
    holds under another name (``nn.MultiheadAttention``'s ``in_proj_weight`` became the column
    layer ``in_proj``) is not compared by name: the output and input gradient still cover it."""
    errors = []
    for name, want in ref.items():
        if name not in got:
            continue
        have = got.get(name)
        if want is not None and have is not None and have.shape != want.shape:
            total = all_reduce(have.double().pow(2).sum().reshape(1), group)
            norm = float(want.double().norm())
            err = abs(float(total.sqrt()) - norm) / max(norm, floor * want.numel() ** 0.5, 1e-12)
        else:
            err = _rel_err(have, want, floor)
        errors.append((f"gradient of {name}", err))
    return errors


_RAISED = "its forward raised"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _check_block(module: nn.Module, cap: CapturedBlock, group, warn: bool = True) -> str | None:
    """What differs in block ``cap.name`` (worst item first), or None; ``warn``: say when the
    original cannot run on its captured inputs."""
    sharded = module.get_submodule(cap.name)
    flags = {m: m.training for m in sharded.modules()}
    sharded.eval()
    cap.reference.eval()
    try:
        try:
            want_out, want_in, want_params = _forward_backward(cap.reference, cap)
        except Exception as exc:  # noqa: BLE001 - the same on every rank: no collective is skipped unevenly
            if warn:
                _unverified(cap.name, exc)
            return None
        try:
            got_out, got_in, got_params = _forward_backward(sharded, cap)
        except Exception as exc:  # noqa: BLE001 - a wrong plan often fails on shapes: report it
            return f"{_RAISED} {type(exc).__name__}: {_first_line(exc)}"
        floor = _scale(list(want_in) + list(want_params.values()))
        errors = [("output", _rel_err(got_out, want_out, 0.0))]
        errors.append(("gradient of the input hidden states", _rel_err(got_in[0], want_in[0], floor)))
        errors += _param_errors(want_params, got_params, group, floor)
    finally:
        for m, mode in flags.items():
            m.training = mode
    tol = tolerance_for(want_out.dtype)
    bad = sorted((e for e in errors if not e[1] <= tol), key=lambda e: -e[1])
    return ", ".join(f"{what} (relative error {err:.3g})" for what, err in bad[:3]) or None


def block_mismatch(module: nn.Module, cap: CapturedBlock, group) -> str | None:
    """What differs between ``module``'s sharded block ``cap.name`` and ``cap.reference`` (worst
    first), or None; local to this rank (the caller reduces the verdict over the group). The
    fallback (:mod:`megastrategy.layers.block_fallback`) asks this of a sharded copy; an original
    that cannot run is reported once, by the check after sharding."""
    return _check_block(module, cap, group, warn=False)


def _unverified(name: str, exc: Exception) -> None:
    """The unsharded block cannot run on the captured inputs (the capture could not reproduce what
    its forward needs): it stays unverified, as a block whose model needs other inputs does."""
    log_on_rank_zero(_log, logging.WARNING, (
        f"megastrategy: the sharded block {name} is not verified against its unsharded original: the original "
        f"raised {type(exc).__name__}: {_first_line(exc)} on the inputs captured for it"))


def verify_sharded_blocks(module: nn.Module, captured: list[CapturedBlock], group, tp: int) -> None:
    """Raise :class:`MegatronConfigError` on every rank if any sharded block differs on any rank."""
    failures = {}
    for cap in captured:
        detail = _check_block(module, cap, group)
        device = next(cap.reference.parameters()).device
        flag = all_reduce(torch.tensor([1.0 if detail else 0.0], device=device), group, op="max")
        if flag.item() > 0:
            failures[cap.name] = (cap, detail or "a mismatch on another tensor-parallel rank")
    if not failures:
        return
    name, (cap, detail) = next(iter(failures.items()))
    raise MegatronConfigError(
        f"tp={tp}: the sharded block {name!r} ({type(cap.reference).__name__}; "
        + (f"entries {', '.join(cap.entries)}; " if cap.entries else "")
        + f"plan from {', '.join(cap.sources)}) does not compute what the unsharded block computes on a random "
        f"input: {detail}. Refusing to train on a plan that would be silently wrong or fail in the first step"
        + (f" (also wrong: {', '.join(repr(n) for n in list(failures)[1:])})" if len(failures) > 1 else "")
        + f". Fix its entries in tp_plan, e.g. tp_plan={{'*': 'auto', {globify(name)!r}: 'replicate'}} to keep "
        f"the block whole, or give each of its layers the right style ('column' for a projection whose output "
        f"is split by heads, 'row' for the layer consuming it)" + _raised_hint(detail) + "."
    )


def _raised_hint(detail: str) -> str:
    """What works when the sharded forward raised (usually a reshape to the full size)."""
    if not detail.startswith(_RAISED):
        return ""
    return ("; a forward that splits or reshapes with the full sizes (nanoGPT's split(C) and y.view(B, T, C), "
            "a head count stored on the module) cannot run on the local heads: read the sizes from the tensor "
            "(split(x.shape[-1] // 3), y.view(B, T, -1)), "
            "or use the built-in plan, tp_plan={'*': 'auto'}, where megastrategy recognizes the model "
            "(Hugging Face, LitGPT, torch.nn)")
