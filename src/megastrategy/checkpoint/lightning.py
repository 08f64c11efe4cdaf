"""What ``MegatronStrategy.save_checkpoint`` / ``load_checkpoint`` do with Lightning's checkpoint dict.

Saving: ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]`` are replaced by the
module's and optimizers' own tensors in canonical form (see :mod:`.sharded`); everything else
(loops, callbacks, epoch, lr schedulers, hparams, user keys) is stored as one object.

Loading returns a dict Lightning can restore from, in either order Lightning may call it:

* before the strategy's ``setup`` (the module is still the user's unsharded module; this is
  what ``fit(ckpt_path=...)`` does): ``state_dict`` is the user's full original state dict,
  which Lightning loads into the full module and ``setup`` then shards;
* after it (the module is already sharded, e.g. ``trainer.validate(ckpt_path=...)`` after a
  ``fit``): the checkpoint is loaded in place into the local shards and ``state_dict`` is the
  module's own ``state_dict()``, so Lightning's ``load_state_dict`` is a no-op copy.

``optimizer_states`` is a :class:`~.sharded.DeferredOptimizerStates`: read when Lightning
restores the optimizers, i.e. after ``setup`` created them, for the layout then in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import Tensor

from megastrategy.checkpoint.averaged_layout import without_absent_averaged_models
from megastrategy.checkpoint.compatibility import check_model_matches
from megastrategy.checkpoint.dcp_io import PathLike, read_metadata
from megastrategy.checkpoint.resume import ExactResume
from megastrategy.checkpoint.swa_state import SWA_KEY, hold_swa_states, take_swa_states
from megastrategy.checkpoint.sharded import (
    DeferredOptimizerStates,
    load_full_model_state,
    load_model_,
    load_optimizer_states,
    read_info,
    read_lightning_metadata,
    read_rank_state,
    read_rank_states,
    save_sharded,
    saved_model_shapes,
)

_TENSOR_KEYS = ("state_dict", "optimizer_states")


@dataclass
class CheckpointSite:
    """What saving and loading need to know about the running job (explicit values, no strategy)."""

    module: Any
    parallel_state: Any
    optimizers: Callable[[], list]
    layout_record: dict[str, Any]
    global_rank: int
    is_coordinator: bool
    barrier: Callable[[], None]
    exact_resume: ExactResume
    plan: Any = None
    stack_path: Optional[str] = None
    rng_tracker: Any = None
    write: Optional[Callable[..., None]] = None  # None: synchronous (dcp_io.save_state)


def save_lightning_checkpoint(site: CheckpointSite, checkpoint: dict[str, Any], filepath: PathLike) -> None:
    """Collective: every rank writes its shards of ``checkpoint`` into the directory ``filepath``."""
    module = site.module
    with_optim = "optimizer_states" in checkpoint
    lightning = {k: v for k, v in checkpoint.items() if k not in _TENSOR_KEYS}
    if isinstance(lightning.get("callbacks"), dict):
        lightning["callbacks"] = dict(lightning["callbacks"])  # take_swa_states edits it, not Lightning's dict
    rank_state = site.exact_resume.rank_state(site.rng_tracker, getattr(module, "_trainer", None))
    rank_state[SWA_KEY] = take_swa_states(lightning)
    save_sharded(
        filepath,
        module=module,
        parallel_state=site.parallel_state,
        optimizers=site.optimizers() if with_optim else None,
        optimizer_states=list(checkpoint["optimizer_states"]) if with_optim else None,
        lightning=lightning,
        plan=site.plan,
        stack_path=site.stack_path,
        layout_record=site.layout_record,
        is_coordinator=site.is_coordinator,
        barrier=site.barrier,
        rank_state=rank_state,
        **({"write": site.write} if site.write is not None else {}),
    )


def load_lightning_checkpoint(site: CheckpointSite, path: PathLike) -> dict[str, Any]:
    """Lightning's checkpoint dict for ``path``, on any layout (see the module docstring)."""
    info = read_info(path)
    checkpoint = read_lightning_metadata(path)
    module = site.module
    trainer = getattr(module, "_trainer", None)
    if trainer is not None and trainer.state.fn == "fit":  # random streams and loader position for the restart
        _load_resume_state(site, path, info.get("layout"))
    fitting = trainer is not None and trainer.state.fn == "fit"
    hold_swa_states(checkpoint, trainer, read_rank_state(path, site.global_rank) if fitting else None,
                    info.get("layout") == site.layout_record, f"written by {info.get('layout')}, resumed on {site.layout_record}")
    if getattr(module, "_megastrategy_sharded", False):
        strict = bool(getattr(module, "strict_loading", True))
        load_model_(path, module, site.parallel_state, plan=site.plan, strict=strict)
        checkpoint["state_dict"] = module.state_dict()
    else:
        _check_whole_model(path, module)
        checkpoint["state_dict"] = load_full_model_state(path)
    count = info.get("num_optimizers")
    if count is not None:  # None: a weights-only checkpoint
        checkpoint["optimizer_states"] = DeferredOptimizerStates(
            count,
            lambda: load_optimizer_states(path, site.module, site.optimizers(), site.parallel_state, plan=site.plan),
        )
    return checkpoint


def _load_resume_state(site: CheckpointSite, path: PathLike, saved: Optional[dict[str, Any]]) -> None:
    here = site.layout_record
    if saved == here:
        site.exact_resume.load(read_rank_state(path, site.global_rank))
        return
    world = int((saved or {}).get("world_size") or 0)
    site.exact_resume.load_other_layout(
        read_rank_states(path, range(world)), saved_dp=(saved or {}).get("dp"), describe=f"{saved} -> {here}"
    )


def _check_whole_model(path: PathLike, module: Any) -> None:
    """Before Lightning loads the full state dict into the user's (not yet sharded) module."""
    here = {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, Tensor)}
    if here:  # a model built later (configure_model) is checked when it is loaded in place
        saved = without_absent_averaged_models(saved_model_shapes(read_metadata(path).state_dict_metadata), here)
        check_model_matches(path, saved, here, strict=bool(getattr(module, "strict_loading", True)), whole=True)
