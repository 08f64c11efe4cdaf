"""Lightning's checkpoint methods for a strategy whose ranks each hold shards of one model.

Every rank takes part in a save and a load: a checkpoint is a ``torch.distributed.checkpoint``
directory in the user's original names and shapes, so it resumes on any layout. The work is the
:class:`~megastrategy.checkpoint.component.Checkpoints` component's; this mixin is Lightning's
entry points to it.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, ContextManager, Optional

from megastrategy.checkpoint.dcp_io import remove_checkpoint_dir
from megastrategy.checkpoint.sharded import MODEL
from megastrategy.checkpoint.streaming import DEFAULT_SHARD_BYTES, write_safetensors_shards

__all__ = ["CheckpointMethods"]


class CheckpointMethods:
    """A mixin for a Lightning strategy with a ``checkpoints`` component (placed before ``DDPStrategy``)."""

    checkpoints: Any

    def wait_for_param_gather(self) -> None:
        """Finish background parameter gathers before parameters are read (the strategy's own)."""

    def module_in_use(self) -> ContextManager[None]:
        """A span in which every rank uses the split module after a fit (the strategy's own)."""
        return nullcontext()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Collective: every rank writes its own shards into the checkpoint directory ``filepath``."""
        if storage_options is not None:
            raise TypeError("MegatronStrategy.save_checkpoint: storage_options are not supported.")
        self.wait_for_param_gather()  # overlap_param_gather: the step's update in every parameter
        barrier = lambda: self.barrier("megastrategy.save_checkpoint")  # noqa: E731
        with self.module_in_use():  # trainer.save_checkpoint after fit reads the module's tensors
            self.checkpoints.save(self.lightning_module, lambda: list(self.optimizers), checkpoint, filepath, barrier)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Collective: every rank reads the shards its layout needs, whatever layout wrote them."""
        return self.checkpoints.load(self.lightning_module, lambda: list(self.optimizers), checkpoint_path)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            remove_checkpoint_dir(filepath)

    def export_safetensors(self, out_dir, *, strip: str = "", max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """Collective, one call from the running job: the model's weights, whole and in the user's
        names (``strip`` removed), as safetensors shards of at most ``max_shard_bytes`` in ``out_dir``.

        Every rank writes its own shards to a staging checkpoint beside ``out_dir`` (no gather);
        rank 0 then assembles one tensor at a time, so no process ever holds the whole model.
        """
        self.wait_for_param_gather()
        out = Path(out_dir)
        staging = out.with_name(out.name + ".staging")
        with self.module_in_use():
            self.checkpoints.save(self.lightning_module, lambda: [], {}, staging,
                                  lambda: self.barrier("megastrategy.export"))
        self.checkpoints.wait_for_writes()  # with async_checkpoint=True the save returns before it is written
        try:
            if self.is_global_zero:
                write_safetensors_shards(staging, out, prefix=MODEL, strip=strip, max_shard_bytes=max_shard_bytes)
            self.barrier("megastrategy.export")
        finally:
            self.remove_checkpoint(staging)

    def export_hf(self, out_dir, *, model_attr: str = "model", max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """Collective: the Hugging Face model the module holds as ``self.<model_attr>``, written as
        ``from_pretrained`` reads it (its config and safetensors shards), straight from the ranks."""
        model = getattr(self.lightning_module, model_attr, None)
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            raise ValueError(f"export_hf: the module's {model_attr!r} is not a Hugging Face model (no .config); "
                             "pass model_attr= naming the attribute that holds it, or use export_safetensors().")
        self.export_safetensors(out_dir, strip=f"{model_attr}.", max_shard_bytes=max_shard_bytes)
        if self.is_global_zero:
            config.save_pretrained(str(out_dir))
            if getattr(model, "generation_config", None) is not None and hasattr(model, "can_generate") and model.can_generate():
                model.generation_config.save_pretrained(str(out_dir))
