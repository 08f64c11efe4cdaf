"""Lightning callbacks that cannot do on a split model what they do on one device: refused before
training, naming what to do instead (a silent difference or a hang would be found much later).

* ``ModelPruning`` picks the weights to prune by magnitude: under tp each rank ranks its shard's
  values (``l1_unstructured``) and, with ``use_global_unstructured=True`` (its default), the
  threshold is taken over this rank's parameters only, a stage's under pp. Other weights than one
  device's are zeroed (a tp2 run's losses left DDP's after the first pruning).
* ``OnExceptionCheckpoint`` saves, collectively, when the fit raises. Under pp an exception in the
  training step is raised by the stage that runs the line first, while the other stages wait for
  its activations, so the save never completes: the job hangs instead of failing.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import ModelPruning, OnExceptionCheckpoint

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_callbacks"]


def refuse_callbacks(callbacks: list, tp: int, pp: int) -> None:
    for callback in callbacks:
        if isinstance(callback, ModelPruning) and (tp > 1 or (pp > 1 and callback._use_global_unstructured)):
            raise MegatronConfigError(
                f"ModelPruning with tp={tp}, pp={pp}: it ranks weights by magnitude over what this rank holds "
                "(a tensor-parallel shard; with use_global_unstructured=True, this pipeline stage's parameters), "
                "so other weights than one device's would be pruned. Prune the whole model in one process "
                "(torch.nn.utils.prune on MyModule.load_from_checkpoint(...)) before or after training, "
                "use pp > 1 only with ModelPruning(use_global_unstructured=False) and tp=1, or train with dp only.")
        if isinstance(callback, OnExceptionCheckpoint) and pp > 1:
            raise MegatronConfigError(
                f"OnExceptionCheckpoint with pp={pp}: an exception in the training step is raised first by the stage "
                "that runs that line while the other stages wait for its activations, and the checkpoint the callback "
                "saves needs every rank, so the job would hang instead of failing. Save regularly instead: "
                "ModelCheckpoint(save_last=True, every_n_train_steps=N) and resume with fit(ckpt_path='last') "
                "(an exact mid-epoch resume), or use pp=1.")
