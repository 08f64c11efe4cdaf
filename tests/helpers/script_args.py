"""What every launched test script shares: the command line (where to write, which strategy, which
layout) and the way out."""
from __future__ import annotations

import argparse
import os
import sys


def layout_parser() -> argparse.ArgumentParser:
    """``--out``, ``--strategy ddp|megatron``, ``--tp``, ``--pp``, ``--vp``; a script adds its own options."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp", "megatron"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=None)
    return p


def launcher_env() -> dict[str, str]:
    """The launcher's rendezvous variables, to restore before each of several fits in one process:
    Lightning's teardown removes them."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    return {k: os.environ[k] for k in keys if k in os.environ}


def leave_without_static_destructors() -> None:
    """End the process after a clean run without C++ static destructors: gloo's threads can abort
    the process at interpreter exit ("terminate called without an active exception")."""
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
    os._exit(0)


def run_each(names: list[str], train_one, out: str, record_errors: bool = True) -> None:
    """Train each named model in turn in this process (``train_one(name)`` gives its result); rank 0
    writes ``{name: result}`` to ``out``, then leave (:func:`leave_without_static_destructors`).

    With ``record_errors`` an exception becomes ``{"error": type, "message": text}`` and the next model
    runs: a refusal is part of what the matrix scripts test."""
    import json
    import traceback
    from pathlib import Path

    env, results = launcher_env(), {}
    for name in names:
        os.environ.update(env)  # Lightning's teardown removes the launcher's variables
        try:
            results[name] = train_one(name)
        except Exception as error:  # noqa: BLE001 - recorded, see above
            if not record_errors:
                raise
            traceback.print_exc()
            results[name] = {"error": type(error).__name__, "message": str(error)}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    leave_without_static_destructors()


def short_fit_trainer(args: argparse.Namespace, callbacks: list, max_steps: int, **megatron: object):
    """A quiet ``Trainer`` for a few steps, one validation at the end, no logger or checkpoints, on
    Lightning's ``DDPStrategy`` or ``MegatronStrategy(tp, pp, **megatron)`` as ``args`` say."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    if args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=args.tp, pp=args.pp, **megatron)
    return L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=max_steps,
        val_check_interval=max_steps, limit_val_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )


def step_losses_callback():
    """A Lightning callback whose ``losses`` list gets each training step's loss, as rank 0 saw it."""
    import lightning as L

    class StepLosses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    return StepLosses()


def fit_and_report(
    args: argparse.Namespace, module, data, max_steps: int, extra=None, **megatron: object
) -> None:
    """Fit ``module`` on ``data`` (batches of 8, the same data for validation) with
    :func:`short_fit_trainer`; rank 0 writes the per-step losses, the validation loss and
    ``extra(trainer)``'s items to ``args.out``; ``megatron`` goes to the strategy; then leave (:func:`leave_without_static_destructors`)."""
    import json
    from pathlib import Path

    from torch.utils.data import DataLoader

    losses = step_losses_callback()
    trainer = short_fit_trainer(args, [losses], max_steps=max_steps, **megatron)
    trainer.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    report = {"losses": losses.losses, "val_loss": float(trainer.callback_metrics["val_loss"])}
    report.update(extra(trainer) if extra is not None else {})
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(report))
    leave_without_static_destructors()
