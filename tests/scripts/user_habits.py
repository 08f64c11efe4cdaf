"""Ordinary Lightning habits around a fine-tuned Hugging Face BERT classifier.

``HabitBert`` (tests/helpers/habit_model.py) calls ``self.save_hyperparameters()``, may freeze its
embeddings and first encoder layers, builds its optimizer from the trainable or from all
parameters, returns a scheduler dict (``ReduceLROnPlateau`` on ``val_loss``, ``OneCycleLR`` or
``get_linear_schedule_with_warmup`` over ``trainer.estimated_stepping_batches``) and validates on two
loaders. The Trainer adds what users add: gradient clipping by value or norm, ``LearningRateMonitor``,
``CSVLogger``, ``val_check_interval=0.5``, ``max_steps`` mid-epoch, ``ModelCheckpoint(monitor)``;
optionally ``trainer.validate`` before ``fit`` and ``fit`` twice. Launched on N processes by
tests/helpers/launch.py; rank 0 writes the step losses, metrics.csv rows, LR records, the best
checkpoint's path, the L1 norm of its weights reloaded by ``HabitBert.load_from_checkpoint`` on rank 0
alone, and the frozen weights' drift to ``--out``.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from tests.helpers.habit_model import HabitBert  # noqa: E402
from tests.helpers.script_args import layout_parser, leave_without_static_destructors  # noqa: E402


class StepLosses(L.Callback):
    """The loss of every training step, as ``on_train_batch_end`` sees it."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class FrozenDrift(L.Callback):
    """How far each frozen parameter this rank holds (a TP shard too) moved during fit: zero, as under
    DDP, where the optimizer skips them (no gradient, so no weight decay either)."""

    def __init__(self):
        self.before, self.drift = {}, {}

    def on_train_start(self, trainer, pl_module):  # after the strategy sharded and cut the module
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters() if not p.requires_grad}

    def on_train_end(self, trainer, pl_module):
        for n, p in pl_module.named_parameters():
            if n in self.before:
                self.drift[n] = max(self.drift.get(n, 0.0), float((p.detach() - self.before[n]).abs().max()))


def _args():
    p = layout_parser()
    p.add_argument("--dir", required=True, help="logs and checkpoints go here")
    p.add_argument("--freeze-embeddings", action="store_true")
    p.add_argument("--freeze-layers", type=int, default=0)
    p.add_argument("--all-params", action="store_true", help="optimizer over all parameters, frozen ones included")
    p.add_argument("--param-groups", action="store_true", help="encoder and head in two groups, two lrs")
    p.add_argument("--scheduler", default="none", choices=["none", "plateau", "onecycle", "linear"])
    p.add_argument("--clip", default="none", choices=["none", "value", "norm"])
    p.add_argument("--max-steps", type=int, default=13)
    p.add_argument("--validate-first", action="store_true")
    p.add_argument("--zero", action="store_true", help="MegatronStrategy(use_distributed_optimizer=True)")
    p.add_argument("--fit-twice", action="store_true", help="a second fit on the same Trainer, max_steps raised")
    return p.parse_args()


def _trainer(args, strategy, steps: StepLosses, drift: FrozenDrift) -> L.Trainer:
    clip = {} if args.clip == "none" else {"gradient_clip_val": 0.01 if args.clip == "value" else 0.5,
                                           "gradient_clip_algorithm": args.clip}
    return L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=3,
        max_steps=args.max_steps, val_check_interval=0.5, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False, logger=CSVLogger(args.dir, name="csv", version=0), log_every_n_steps=1,
        callbacks=[steps, drift, LearningRateMonitor(logging_interval="step"),
                   ModelCheckpoint(dirpath=Path(args.dir) / "ckpt", monitor="val_loss", save_top_k=1)],
        **clip,
    )


def main() -> None:
    args = _args()
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    module = HabitBert(freeze_embeddings=args.freeze_embeddings, freeze_layers=args.freeze_layers,
                       all_params=args.all_params, param_groups=args.param_groups, scheduler=args.scheduler)
    if args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=args.tp, pp=args.pp, use_distributed_optimizer=args.zero)
    steps, drift = StepLosses(), FrozenDrift()
    trainer = _trainer(args, strategy, steps, drift)
    validated = trainer.validate(module, verbose=False) if args.validate_first else None
    trainer.fit(module)
    if args.fit_twice:
        trainer.fit_loop.max_epochs, trainer.fit_loop.epoch_loop.max_steps = 4, args.max_steps + 4
        trainer.fit(module)
    if trainer.is_global_zero:
        _write(args, trainer, steps, validated, drift.drift)
    leave_without_static_destructors()


def _write(args, trainer, steps, validated, drift) -> None:
    metrics_csv = Path(args.dir) / "csv" / "version_0" / "metrics.csv"
    with open(metrics_csv) as f:
        rows = list(csv.DictReader(f))
    best = trainer.checkpoint_callback.best_model_path
    # rank 0 alone reloads the best model inside the job, as a script does after fit
    best_weights_l1 = float(sum(t.abs().sum() for t in HabitBert.load_from_checkpoint(best).state_dict().values()))
    Path(args.out).write_text(json.dumps({
        "losses": steps.losses, "csv": rows, "best": best, "best_score": float(trainer.checkpoint_callback.best_model_score),
        "best_weights_l1": best_weights_l1,
        "validate_first": validated, "frozen_drift": drift, "global_step": trainer.global_step,
        "final": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }))


if __name__ == "__main__":
    main()
