"""A training dataloader that resumes mid-epoch at the next unseen batch.

Lightning restores a mid-epoch checkpoint's loop counters but restarts an ordinary
``DataLoader`` at the first batch of the epoch, so a resumed run trains on batches it has
already seen (it warns "your dataloader is not resumable"). Lightning does resume loaders
that implement ``state_dict``/``load_state_dict``; :class:`ResumableLoader` gives any
loader that interface:

* its state is the number of batches of the current epoch the training loop has finished
  (read from the trainer when the checkpoint is written, so batches the loop prefetched but
  did not train on are not counted);
* when resumed, the next iterator first replays the epoch's start: it creates the inner
  iterator from the random state the original run had at that moment, so a ``RandomSampler``
  draws the same permutation and worker processes get the same seeds, then it fetches and
  discards the finished batches, which also advances any per-worker random augmentation
  exactly as the original run did.

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

__all__ = ["ResumableLoader"]

_OWN = frozenset({"loader", "_batches_done", "epoch_start_rng", "_skip", "_replay_rng"})


class ResumableLoader:
    """Wraps ``loader``; ``batches_done()`` is the trainer's count of finished batches this epoch.

    Every attribute the wrapper does not define is the inner loader's (``sampler``,
    ``batch_sampler``, ``dataset``, ``num_workers``...), so Lightning's sampler-epoch updates
    and length checks reach the real loader.
    """

    def __init__(self, loader: Any, batches_done: Callable[[], int]) -> None:
        self.loader = loader
        self._batches_done = batches_done
        self.epoch_start_rng: Optional[torch.Tensor] = None  # torch CPU state when this epoch's iterator was made
        self._skip = 0  # batches to discard at the next iterator (set by load_state_dict)
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

    # ------------------------------------------------------------------ Lightning's _Stateful
    def state_dict(self) -> dict[str, int]:
        return {"batches_done": int(self._batches_done())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state.get("batches_done", 0))

    def resume_from(self, epoch_start_rng: Optional[torch.Tensor]) -> None:
        """The resumed epoch's start state (this rank's, from the checkpoint)."""
        self._replay_rng = epoch_start_rng

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        skip, replay = self._skip, self._replay_rng
        self._skip, self._replay_rng = 0, None
        try:
            total = len(self.loader)
        except TypeError:  # an iterable without length: skip what we can
            total = None
        if total is not None and skip >= total:
            skip = 0  # the checkpoint ended the epoch: a new epoch starts from its first batch
        if replay is None:
            self.epoch_start_rng = torch.get_rng_state()
            return iter(self.loader)
        # Replay the epoch's start on the saved state: samplers draw their order lazily, at the
        # first batch, so the state stays installed until the finished batches are skipped.
        now = torch.get_rng_state()
        torch.set_rng_state(replay)
        self.epoch_start_rng = replay.clone()
        try:
            inner = iter(self.loader)
            for _ in range(skip):
                next(inner)
        finally:
            torch.set_rng_state(now)
        return inner
