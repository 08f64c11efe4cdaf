"""Which submodule each ``AveragedModel`` copy averages, so its tensors are stored like the source's.

A user's ``torch.optim.swa_utils.AveragedModel`` (an EMA) made after the strategy set the model up
deep-copies the rank's sharded (or pipeline-cut) submodule. ``copy.deepcopy`` of a parameter drops
the attributes the checkpoint reads (the :class:`~megastrategy.layers.shard_spec.ShardSpec`, the
expert description), and a Hugging Face ``Conv1D``'s ``[in, out]`` storage is recorded by the
source's module name: read from the copy alone, a tp shard would be stored as if whole.

The copy is structurally the source (same state-dict keys and shapes), so it is paired with it by
that: :func:`averaged_sources` maps each copy's key prefix to its source's, and
:func:`~megastrategy.checkpoint.layout.module_layout` describes a copy's tensor by its source's
(same split, same orientation) under the copy's own name. Elementwise averaging keeps the split
exact. Two sources with the same structure but different splits cannot be told apart: refused.

Resuming ``fit`` reads the checkpoint before the user's ``on_load_checkpoint`` (where an EMA is built
so that the saved average has a module to load into, as DDP's strict loading needs): the early
whole-model check leaves such saved ``AveragedModel``s out (:func:`without_absent_averaged_models`).
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from megastrategy.errors import MegatronCheckpointError

__all__ = ["averaged_candidates", "averaged_sources", "without_absent_averaged_models"]


def _signature(module: nn.Module) -> tuple:
    return tuple((k, tuple(t.shape)) for k, t in module.state_dict(keep_vars=True).items() if isinstance(t, Tensor))


def _split_of(module: nn.Module) -> tuple:
    """What distinguishes two structurally equal sources: every tensor's split attributes."""
    from megastrategy.layers.shard_spec import get_shard_spec
    from megastrategy.moe.expert_attr import EXPERT_ATTR

    def expert(t: Tensor) -> tuple:
        info = getattr(t, EXPERT_ATTR, None)
        return tuple(getattr(info, f, None) for f in ("etp_dim", "etp_size", "etp_rank", "ep_dim", "ep_size", "ep_rank"))

    return tuple((k, get_shard_spec(t), expert(t))
                 for k, t in module.state_dict(keep_vars=True).items() if isinstance(t, Tensor))


def averaged_candidates(module: nn.Module) -> dict[str, list[str]]:
    """``{AveragedModel path: paths of the submodules outside every AveragedModel that have its
    copy's structure}`` for every ``AveragedModel`` in ``module`` whose copy holds tensors."""
    from torch.optim.swa_utils import AveragedModel

    named = dict(module.named_modules())
    averaged = [path for path, sub in named.items() if isinstance(sub, AveragedModel)]
    inside = lambda path: any(path == a or path.startswith(a + ".") for a in averaged)  # noqa: E731
    out: dict[str, list[str]] = {}
    for path in averaged:
        wanted = _signature(named[path].module)
        if wanted:
            out[path] = [p for p, sub in named.items() if not inside(p) and _signature(sub) == wanted]
    return out


def averaged_sources(module: nn.Module) -> dict[str, str]:
    """``{"<copy path>.module.": "<source path>."}`` for every ``AveragedModel`` in ``module`` whose
    copy matches a submodule (a copy of nothing in it holds whole tensors: stored as they are)."""
    named = dict(module.named_modules())
    prefix = lambda path: f"{path}." if path else ""  # noqa: E731
    out: dict[str, str] = {}
    for path, found in averaged_candidates(module).items():
        if not found:
            continue
        if len({_split_of(named[p]) for p in found}) > 1:
            raise MegatronCheckpointError(
                f"the AveragedModel at {path!r} has the structure of several submodules ({found}) that are split "
                "differently over the ranks, so which split its averaged tensors have cannot be told; average one "
                "of a unique structure (e.g. the whole stack), or use the StochasticWeightAveraging callback."
            )
        out[prefix(path) + "module."] = prefix(found[0])
    return out


def without_absent_averaged_models(saved: dict[str, Any], here: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (checkpoint key -> shape) without the ``AveragedModel``s (an ``X.n_averaged`` marks
    ``X``) that the module ``here`` lacks yet; Lightning's strict ``load_state_dict``, after the user's
    ``on_load_checkpoint``, still says what is missing or unexpected."""
    absent = tuple(k[: -len("n_averaged")] for k in saved if k.endswith(".n_averaged") and k not in here)
    return {k: v for k, v in saved.items() if not absent or not k.startswith(absent)}
