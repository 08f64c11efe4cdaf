"""A training dataloader that resumes mid-epoch at the next unseen batch, on any layout.

Lightning restores a mid-epoch checkpoint's loop counters but restarts an ordinary
``DataLoader`` at the first batch of the epoch, so a resumed run trains on batches it has
already seen (it warns "your dataloader is not resumable"). Lightning does resume loaders
that implement ``state_dict``/``load_state_dict``; :class:`ResumableLoader` gives any
loader that interface:

* its state is the number of batches of the current epoch the training loop has finished
  (read from the trainer when the checkpoint is written, so batches the loop prefetched but
  did not train on are not counted) and the global batch (per-device batch x dp) they had;
* when resumed, the next iterator fetches and discards the finished batches. The sampler
  megastrategy's strategy gets from Lightning (a ``DistributedSampler`` over the dp ranks,
  seeded by epoch) draws one global order of the epoch whatever the layout, and with the same
  global batch the first ``k`` batches of every dp rank are exactly the first ``k`` global
  batches: so the run continues with the next unseen sample on another tp/pp/cp, and on
  another dp when the global batch is kept (per-device ``batch_size`` scaled). Another global
  batch cannot continue mid-epoch (Lightning's step counters would count other batches): it
  is refused before training with what would work.
* on the same layout the iterator is also created from the random state the original run
  had at the epoch's start (:meth:`resume_from`), so a ``RandomSampler`` draws the same
  permutation, worker processes get the same seeds and per-worker random augmentation
  advances exactly as the original run did.

Skipping costs one epoch-prefix of data loading (no model compute). Loaders that are already
stateful (e.g. ``torchdata``'s ``StatefulDataLoader``) are not wrapped. One case stays inexact:
random transforms that run in the main process (``num_workers=0``) for the first resumed batch,
which Lightning prefetches before the training random state is restored.

The random state at the epoch's start differs per rank, so it travels in the per-rank part
of the checkpoint (:attr:`epoch_start_rng`, set by the strategy), not in this object's
``state_dict`` (which Lightning stores once, from rank 0).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch

from megastrategy.errors import CheckpointMismatchError

__all__ = ["ResumableLoader"]

_OWN = frozenset({"loader", "_batches_done", "_data_parallel", "epoch_start_rng", "_skip", "_saved_batch", "_replay_rng"})


class ResumableLoader:
    """Wraps ``loader``; ``batches_done()`` is the trainer's count of finished batches this epoch,
    ``data_parallel`` the number of dp ranks (to tell the global batch).

    Every attribute the wrapper does not define is the inner loader's (``sampler``,
    ``batch_sampler``, ``dataset``, ``num_workers``...), so Lightning's sampler-epoch updates
    and length checks reach the real loader.
    """

    def __init__(self, loader: Any, batches_done: Callable[[], int], data_parallel: int = 1) -> None:
        self.loader = loader
        self._batches_done = batches_done
        self._data_parallel = data_parallel
        self.epoch_start_rng: Optional[torch.Tensor] = None  # torch CPU state when this epoch's iterator was made
        self._skip = 0  # batches to discard at the next iterator (set by load_state_dict)
        self._saved_batch: Optional[int] = None  # the global batch the checkpointed run had
        self._replay_rng: Optional[torch.Tensor] = None  # the resumed epoch's start state

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not yet set (e.g. during unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # What Lightning sets after wrapping (``worker_init_fn`` when workers are seeded) must
        # reach the real loader, or its workers would start unseeded and draw other masks.
        if name in _OWN or "loader" not in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    @property
    def global_batch(self) -> Optional[int]:
        """Samples per optimizer-loop batch over all dp ranks (``None``: a custom batch sampler)."""
        size = getattr(self.loader, "batch_size", None)
        return None if size is None else int(size) * self._data_parallel

    # ------------------------------------------------------------------ Lightning's _Stateful
    def state_dict(self) -> dict[str, Any]:
        return {"batches_done": int(self._batches_done()), "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skip = int(state.get("batches_done", 0))
        self._saved_batch = state.get("global_batch")
        self._check_global_batch()

    def resume_from(self, epoch_start_rng: Optional[torch.Tensor]) -> None:
        """The resumed epoch's start state (from the checkpoint; only on the same data layout)."""
        self._replay_rng = epoch_start_rng

    def _epoch_length(self) -> Optional[int]:
        try:
            return len(self.loader)
        except TypeError:  # an iterable without length
            return None

    def _check_global_batch(self) -> None:
        """Refuse, before any step, a mid-epoch resume whose batches would be other samples."""
        total = self._epoch_length()
        mid_epoch = self._skip > 0 and (total is None or self._skip < total)
        saved, now = self._saved_batch, self.global_batch
        if not mid_epoch or saved is None or now is None or saved == now:
            return
        dp = self._data_parallel
        fix = f"batch_size={saved // dp}" if saved % dp == 0 else f"a batch_size that makes the global batch {saved}"
        raise CheckpointMismatchError(
            f"resume: the checkpoint is {self._skip} batches into an epoch with a global batch of {saved} samples, "
            f"but this run's global batch is {now} (batch_size {now // dp} x dp {dp}); mid-epoch the position is "
            f"only defined for the same global batch. Use {fix} per device (dp={dp}), or resume from a "
            "checkpoint taken at an epoch end."
        )

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        skip, replay = self._skip, self._replay_rng
        self._skip, self._replay_rng = 0, None
        total = self._epoch_length()
        if total is not None and skip >= total:
            skip = 0  # the checkpoint ended the epoch: a new epoch starts from its first batch
        if replay is None:
            self.epoch_start_rng = torch.get_rng_state()
            return self._skipped(iter(self.loader), skip)
        # Replay the epoch's start on the saved state: samplers draw their order lazily, at the
        # first batch, so the state stays installed until the finished batches are skipped.
        now = torch.get_rng_state()
        torch.set_rng_state(replay)
        self.epoch_start_rng = replay.clone()
        try:
            return self._skipped(iter(self.loader), skip)
        finally:
            torch.set_rng_state(now)

    @staticmethod
    def _skipped(inner: Iterator[Any], count: int) -> Iterator[Any]:
        for _ in range(count):
            next(inner)
        return inner
