"""Lightning's checkpoint methods for a strategy whose ranks each hold shards of one model.

Every rank takes part in a save and a load: a checkpoint is a ``torch.distributed.checkpoint``
directory in the user's original names and shapes, so it resumes on any layout. The work is the
:class:`~megastrategy.checkpoint.component.Checkpoints` component's; this mixin is Lightning's
entry points to it.
"""
from __future__ import annotations

from typing import Any, Optional

from megastrategy.checkpoint.dcp_io import remove_checkpoint_dir

__all__ = ["CheckpointMethods"]


class CheckpointMethods:
    """A mixin for a Lightning strategy with a ``checkpoints`` component (placed before ``DDPStrategy``)."""

    checkpoints: Any

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Collective: every rank writes its own shards into the checkpoint directory ``filepath``."""
        if storage_options is not None:
            raise TypeError("MegatronStrategy.save_checkpoint: storage_options are not supported.")
        barrier = lambda: self.barrier("megastrategy.save_checkpoint")  # noqa: E731
        self.checkpoints.save(self.lightning_module, lambda: list(self.optimizers), checkpoint, filepath, barrier)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Collective: every rank reads the shards its layout needs, whatever layout wrote them."""
        return self.checkpoints.load(self.lightning_module, lambda: list(self.optimizers), checkpoint_path)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            remove_checkpoint_dir(filepath)
