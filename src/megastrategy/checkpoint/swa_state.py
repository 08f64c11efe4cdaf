"""``StochasticWeightAveraging``'s averaged weights in a sharded checkpoint: one record per rank.

The callback's ``state_dict()`` holds its average model's ``state_dict()``: under tp or pp that is
the rank's shards (:mod:`megastrategy.averaged_copies` makes the copy from the sharded module), but
Lightning's part of the checkpoint is written once, by rank 0, so rank 1 would resume with rank 0's
shards (and, before the strategy's ``setup``, the callback would load them into its unsharded copy: a
size mismatch). So each rank's averaged weights go into its own ``meta/rank_state`` record
(:func:`take_swa_states`), and a resume on the same layout puts them back after the copy is remade
(:func:`hold_swa_states`, then :func:`megastrategy.averaged_copies.copy_sharded_for_swa`).
"""
from __future__ import annotations

from typing import Any, Optional

from megastrategy.errors import MegatronCheckpointError

__all__ = ["SWA_KEY", "take_swa_states", "hold_swa_states", "HELD_ATTR"]

SWA_KEY = "swa_average_models"
HELD_ATTR = "_megastrategy_swa_average_state"  # on the callback, until its sharded copy exists
_PER_RANK = "megastrategy: in meta/rank_state"


def take_swa_states(lightning: dict[str, Any]) -> dict[str, Any]:
    """Move every SWA callback's averaged weights out of Lightning's part; return them by state key."""
    taken: dict[str, Any] = {}
    callbacks = lightning.get("callbacks")
    for key, state in (callbacks or {}).items():
        if _is_swa(key) and isinstance(state, dict) and state.get("average_model_state") is not None:
            taken[key] = state["average_model_state"]
            callbacks[key] = dict(state, average_model_state=_PER_RANK)
    return taken


def hold_swa_states(checkpoint: dict[str, Any], trainer: Any, rank_state: Optional[dict], same_layout: bool,
                    describe: str) -> None:
    """Before Lightning restores the callbacks: give each SWA callback its own copy's state to load
    (a no-op) and, when resuming ``fit`` (``rank_state`` given), keep this rank's saved weights on it
    for after ``setup``."""
    callbacks = checkpoint.get("callbacks") or {}
    saved = [k for k, s in callbacks.items() if _is_swa(k) and isinstance(s, dict) and s.get("average_model_state") == _PER_RANK]
    by_key = {getattr(cb, "state_key", None): cb for cb in getattr(trainer, "callbacks", None) or []}
    for key in saved:  # validate/test with the callback attached load nothing into it
        callback = by_key.get(key)
        if callback is not None and getattr(callback, "_average_model", None) is not None:
            callbacks[key] = dict(callbacks[key], average_model_state=callback._average_model.state_dict())
    if not saved or rank_state is None:
        return
    if not same_layout:
        raise MegatronCheckpointError(
            f"the checkpoint holds StochasticWeightAveraging's averaged weights as each rank's shards ({describe}); "
            "they cannot be resumed on another layout. Resume on the layout that wrote it, or without the "
            "StochasticWeightAveraging callback (weights, optimizer and loop positions restore on any layout)."
        )
    mine = rank_state.get(SWA_KEY) or {}
    for key in saved:
        if key in mine and key in by_key:  # a callback not attached now: Lightning says so itself
            setattr(by_key[key], HELD_ATTR, mine[key])


def _is_swa(key: str) -> bool:
    return str(key).startswith("StochasticWeightAveraging")
