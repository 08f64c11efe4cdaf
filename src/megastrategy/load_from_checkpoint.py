"""``MyModule.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` on a megastrategy
checkpoint, in one plain process, as users load a DDP checkpoint.

A megastrategy checkpoint is a directory of DCP shards; Lightning's ``load_from_checkpoint`` reads
its path through ``lightning.pytorch.core.saving.pl_load``, which opens it as one file, so the user
got ``IsADirectoryError: [Errno 21] Is a directory`` and no hint of ``megastrategy consolidate``.
The same holds for ``trainer.validate/test/predict(model, ckpt_path=...)`` under another strategy
(one device, DDP), which reads through ``lightning.fabric.plugins.io.torch_io.pl_load``.
``import megastrategy`` wraps that one name in those two modules (:func:`install`): a local directory
holding a megastrategy checkpoint is consolidated in this process into the dict a DDP checkpoint
holds -- the user's original full ``state_dict`` and Lightning's saved part (hyper-parameters,
epoch, loops, callbacks, the user's own keys) -- read as data only; every other path goes to
Lightning's own loader unchanged. The optimizer states stay in the shards, keyed by parameter name:
resuming ``fit`` from the checkpoint under another strategy raises :class:`MegatronCheckpointError`
saying to resume with ``MegatronStrategy`` (any layout, one device included). A process that never
imports megastrategy still sees Lightning's error; for a single file to ship,
``megastrategy consolidate CKPT OUT.ckpt --lightning``. Outside the checkpoint package
on purpose: ``import megastrategy`` installs this without importing torch or Lightning.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from megastrategy.import_hooks import when_loaded

__all__ = ["install", "is_megastrategy_checkpoint", "load_as_lightning_checkpoint"]

#: Lightning's modules that read a checkpoint path through their own ``pl_load`` name
READERS = ("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io")


class _OptimizerStatesElsewhere:
    """``checkpoint["optimizer_states"]`` for a strategy that cannot read megastrategy's: using it says so."""

    def __init__(self, path: Any) -> None:
        self.path = path

    def _refuse(self, *_: Any) -> Any:
        from megastrategy.errors import MegatronCheckpointError

        raise MegatronCheckpointError(
            f"{self.path} is a megastrategy checkpoint: its optimizer states are sharded by parameter name, "
            "which only MegatronStrategy reads. Resume fit from it with strategy=MegatronStrategy(...) (any "
            "tp/pp/dp, tp=1, pp=1 on one device too), or load only the weights: MyModule.load_from_checkpoint(path), "
            "trainer.validate/test/predict(model, ckpt_path=path)."
        )

    __iter__ = __len__ = __getitem__ = _refuse


def is_megastrategy_checkpoint(path: Any) -> bool:
    """A local checkpoint directory with DCP's ``.metadata`` (not a file, a URL or a stream)."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def load_as_lightning_checkpoint(path: Any, map_location: Any = None) -> dict[str, Any]:
    """The checkpoint dict DDP would have saved (``optimizer_states``, if saved, refuses use); tensors on the CPU, or
    on ``map_location`` when that is a device (a callable or dict map keeps them on the CPU)."""
    import torch

    from megastrategy.checkpoint.dcp_io import read_metadata
    from megastrategy.checkpoint.sharded import (
        load_full_model_state, optim_groups_key, read_info, read_lightning_metadata,
    )

    read_info(path)  # a clear error for a DCP checkpoint that megastrategy did not write
    checkpoint = read_lightning_metadata(path)
    state_dict = load_full_model_state(path)
    if isinstance(map_location, (str, torch.device)):
        state_dict = {k: v.to(map_location) for k, v in state_dict.items()}
    checkpoint["state_dict"] = state_dict
    if optim_groups_key(0) in read_metadata(path).state_dict_metadata:  # not a save_weights_only checkpoint
        checkpoint["optimizer_states"] = _OptimizerStatesElsewhere(path)
    return checkpoint


def _loader(lightning_load: Callable[..., Any]) -> Callable[..., Any]:
    def load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if is_megastrategy_checkpoint(path_or_url):
            return load_as_lightning_checkpoint(path_or_url, map_location)
        return lightning_load(path_or_url, map_location=map_location, weights_only=weights_only)

    load.megastrategy_wraps = lightning_load
    return load


def _wrap(reader: Any) -> None:
    current = getattr(reader, "pl_load", None)
    if current is not None and not hasattr(current, "megastrategy_wraps"):
        reader.pl_load = _loader(current)


def install() -> None:
    """Wrap ``pl_load`` of each of :data:`READERS` now, or when it loads (idempotent)."""
    for name in READERS:
        when_loaded(name, _wrap, ready=lambda module: hasattr(module, "pl_load"))
