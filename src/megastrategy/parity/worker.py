"""One side of a parity check, run on every rank: ``python -m megastrategy.parity.worker SPEC OUT``.

``SPEC`` is the JSON of a :class:`~megastrategy.parity.check.ParityRun` plus ``"layout"`` (the
``MegatronStrategy`` keywords, or ``null`` for Lightning's ``DDPStrategy``). Rank 0 writes the
per-step losses and gradient norms to ``OUT``.
"""
from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["import_object", "silence_dropout", "train_and_record"]


def import_object(path: str) -> Any:
    """``"package.module:Name"`` (or ``"package.module.Name"``) → the object."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"megastrategy check: {path!r} is not an import path; write 'package.module:ClassName'.")
    return getattr(importlib.import_module(module_name), attr)


def silence_dropout(module: nn.Module) -> int:
    """Turn every dropout of ``module`` off: ``nn.Dropout`` modules and the float ``*dropout*``
    attributes Hugging Face attention passes to the functional dropout. Returns how many changed."""
    changed = 0
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p, changed = 0.0, changed + 1
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float) and value > 0:
                setattr(m, name, 0.0)
                changed += 1
    return changed


class _Recorder:
    """A Lightning callback (built lazily, so this module imports without Lightning's cost)."""

    @staticmethod
    def make() -> Any:
        from lightning.pytorch.callbacks import Callback

        class Recorder(Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []
                self.grad_norms: list[float] = []

            def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
                self.grad_norms.append(float(_global_grad_norm(trainer.strategy, pl_module)))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                self.losses.append(float(loss))

        return Recorder()


def _global_grad_norm(strategy: Any, module: nn.Module) -> torch.Tensor:
    if hasattr(strategy, "grad_norm"):
        return strategy.grad_norm()
    grads = [p.grad.detach().double().norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(grads).norm() if grads else torch.zeros(())


def _strategy(layout: Optional[dict]) -> Any:
    if layout is None:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    from megastrategy import MegatronStrategy

    return MegatronStrategy(**layout)


class _WarningsKept(logging.Handler):
    """megastrategy's own warnings during the run, so that the verdict can say what the strategy
    already said (a summed loss under microbatches, a token mean it could not trace)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)


def train_and_record(spec: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Train ``spec["steps"]`` steps; on rank 0 return what was recorded."""
    import lightning as L

    kept = _WarningsKept()
    logging.getLogger("megastrategy").addHandler(kept)

    L.seed_everything(spec["seed"], workers=True, verbose=False)
    module = import_object(spec["module"])(**spec["module_args"])
    silenced = silence_dropout(module) if spec["dropout_off"] else 0
    datamodule = import_object(spec["datamodule"])(**spec["datamodule_args"]) if spec["datamodule"] else None
    recorder = _Recorder.make()
    trainer = L.Trainer(
        accelerator="cpu", devices=spec["devices"], strategy=_strategy(spec["layout"]), max_steps=spec["steps"],
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder], deterministic=True,
    )
    trainer.fit(module, datamodule=datamodule)
    if trainer.global_rank != 0:
        return None
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "dropouts_silenced": silenced,
            "warnings": kept.messages}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    result = train_and_record(json.loads(Path(spec_path).read_text()))
    if result is not None:
        Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
