"""Exact resume: a run saved at step k and resumed repeats the uninterrupted run's steps k+1...

Lightning's checkpoint already holds the weights, optimizer and LR-scheduler states, the loss
scaler and the loop counters. Two things are missing for a continuation of the same run, and
this object (owned by the strategy) adds them:

* **the position in the epoch** (:mod:`.resumable_loader`): the training loader continues with
  the first sample the checkpointed run had not trained on, on any tp/pp/cp layout and on
  another dp when the global batch is kept;
* **each rank's random streams** (:mod:`.rng`): written into the rank's own record of the
  checkpoint and put back just before training continues (the strategy's ``on_train_start``),
  i.e. after everything that runs only because of the restart (building loaders, the sanity
  check) and before what the original run did next (a validation due at that step, the next
  batch). On the same layout (world size and tp/pp/dp/ep sizes) every stream is restored and
  the continuation is bit-identical; on another layout the streams that can carry over do
  (:mod:`.carry_over`) and the others start afresh, and the run says which.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from torch.utils.data import IterableDataset

from megastrategy.checkpoint.carry_over import carry_over
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
        self.dp_rank, self.dp_size, self.data_source = 0, 1, True

    def set_position(self, *, dp_rank: int, dp_size: int, data_source: bool) -> None:
        """This rank's data-parallel rank and size, and whether it loads its replica's batches."""
        self.dp_rank, self.dp_size, self.data_source = dp_rank, dp_size, data_source

    # ------------------------------------------------------------------ data
    def wrap_train_loader(self, loader: Any, trainer: Any) -> Any:
        """The training loader as a resumable one (stateful loaders are returned unchanged)."""
        if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
            return loader  # Lightning already saves and restores its position
        done = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed  # noqa: E731
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            _warn_unpositionable(loader, done())
            return loader
        wrapped = ResumableLoader(loader, done, self.dp_size)
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
        return {"rng": capture_rng_states(tracker), "epoch_start_rng": [dl.epoch_start_rng for dl in loaders],
                "dp_rank": self.dp_rank, "data_source": self.data_source}

    def load(self, rank_state: Optional[dict[str, Any]]) -> None:
        """The same layout wrote the checkpoint: keep this rank's own saved state for the restart."""
        self._made_since_load = 0
        self._pending = rank_state

    def load_other_layout(self, saved: list[dict[str, Any]], *, saved_dp: Any, describe: str) -> None:
        """Another layout wrote it: keep what every saved rank this one could be agrees on."""
        self._made_since_load = 0
        carried = carry_over(saved, dp_rank=self.dp_rank, same_dp=saved_dp == self.dp_size)
        self._pending = {"rng": carried.rng, "epoch_start_rng": carried.epoch_start_rng or []}
        log_on_rank_zero(
            log, logging.WARNING,
            f"megastrategy: the checkpoint was written by another layout ({describe}); weights, optimizer, loop "
            "counters and the position in the epoch are restored (the next unseen sample comes next). Random streams "
            f"carried over: {', '.join(carried.kept) or 'none'}; starting afresh: {', '.join(carried.fresh) or 'none'} "
            "(a stream the saved ranks did not share has no counterpart here), so with dropout or random "
            "augmentation the continuation is not bit-identical (it is on the same layout)."
        )

    def restore_random_states(self, tracker: Any) -> None:
        """Just before training continues: put back this rank's saved random streams (once)."""
        if self._pending is None or "rng" not in self._pending:
            return
        restore_rng_states(self._pending["rng"], tracker)
        self._pending = None


def _warn_unpositionable(loader: Any, batches_done: int) -> None:
    if batches_done <= 0:
        return
    size = getattr(loader, "batch_size", None)
    samples = f" ({batches_done * size} samples per rank)" if size else ""
    log_on_rank_zero(
        log, logging.WARNING,
        f"megastrategy: the training loader reads an IterableDataset ({type(loader.dataset).__name__}) that has no "
        f"state_dict/load_state_dict, so it cannot be positioned: the resumed epoch starts again at its first "
        f"batch and the {batches_done} batches{samples} trained before the checkpoint are seen again. Give the "
        "loader state_dict/load_state_dict (e.g. torchdata's StatefulDataLoader) to continue where it stopped."
    )
