"""Exact resume: a run saved at step k and resumed repeats the uninterrupted run's steps k+1...

Lightning's checkpoint already holds the weights, optimizer and LR-scheduler states, the loss
scaler and the loop counters. Two things are missing for a bit-exact continuation, and this
object (owned by the strategy) adds them:

* **each rank's random streams** (:mod:`.rng`): written into the rank's own record of the
  checkpoint and put back just before training continues (the strategy's ``on_train_start``),
  i.e. after everything that runs only because of the restart (building loaders, the sanity
  check) and before what the original run did next (a validation due at that step, the next
  batch);
* **the position in the epoch** (:mod:`.resumable_loader`): the training loader continues with
  the first batch the checkpointed run had not trained on, in the same shuffled order.

Both are restored only when the checkpoint was written by the same layout (world size and
tp/pp/dp/ep sizes). On another layout the random streams cannot correspond (a TP rank's
stream, a stage's dropout draws), so the run continues from the weights, optimizer and loop
position with fresh random states, and says so.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from megastrategy.checkpoint.resumable_loader import ResumableLoader
from megastrategy.checkpoint.rng import capture_rng_states, restore_rng_states
from megastrategy.rank_zero import log_on_rank_zero

log = logging.getLogger(__name__)

__all__ = ["ExactResume"]


class ExactResume:
    """Per-rank state for exact resumes (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: Optional[dict[str, Any]] = None
        self._made_since_load = 0  # wrappers created since the last load, in Lightning's loader order

    # ------------------------------------------------------------------ data
    def wrap_train_loader(self, loader: Any, trainer: Any) -> Any:
        """The training loader as a resumable one (stateful loaders are returned unchanged)."""
        if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
            return loader  # Lightning already saves and restores its position
        wrapped = ResumableLoader(loader, lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        starts = (self._pending or {}).get("epoch_start_rng") or []
        index, self._made_since_load = self._made_since_load, self._made_since_load + 1
        if index < len(starts) and starts[index] is not None:
            wrapped.resume_from(starts[index])
        return wrapped

    # ------------------------------------------------------------------ checkpoint
    def rank_state(self, tracker: Any, trainer: Any) -> dict[str, Any]:
        """What this rank writes into ``meta/rank_state/<rank>``."""
        combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
        loaders = [dl for dl in getattr(combined, "flattened", []) if isinstance(dl, ResumableLoader)]
        return {"rng": capture_rng_states(tracker), "epoch_start_rng": [dl.epoch_start_rng for dl in loaders]}

    def load(self, rank_state: Optional[dict[str, Any]], *, same_layout: bool, describe: str) -> None:
        """Keep this rank's saved state for the restart (``describe`` explains a layout change)."""
        self._pending = None
        self._made_since_load = 0
        if rank_state is None:
            return
        if not same_layout:
            log_on_rank_zero(
                log, logging.WARNING,
                f"megastrategy: the checkpoint was written by another layout ({describe}); weights, optimizer "
                "and loop position are restored, random streams start afresh, so the continuation is not "
                "bit-identical to the original run (it is on the same layout)."
            )
            return
        self._pending = rank_state

    def restore_random_states(self, tracker: Any) -> None:
        """Just before training continues: put back this rank's saved random streams (once)."""
        if self._pending is None or "rng" not in self._pending:
            return
        restore_rng_states(self._pending["rng"], tracker)
        self._pending = None
