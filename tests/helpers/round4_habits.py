"""Round-4 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Lightning's own demo modules and callbacks, and module habits users copy from tutorials, each on a
fresh Trainer (``tests/helpers/round3_habits.trainer``: DDPStrategy or MegatronStrategy as ``args``
say); tests/scripts/habits_round4.py runs several in one launch. A report holds per-step losses and
what rank 0 printed, logged, wrote or returned.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary, RichModelSummary
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.models import GPT, TokenDataset
from tests.helpers.round3_habits import StepLosses, trainer


# ---------------------------------------------------------------- 1. Lightning's own demo modules
def boring(args, workdir):
    """``BoringModel`` as Lightning's docs use it: one Linear(32, 2), batch size 1, SGD + StepLR."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    losses = StepLosses()
    t = trainer(args, [losses], plan=None, max_steps=4, limit_val_batches=2)
    t.fit(BoringModel())
    return {"losses": losses.losses}


class Digits(Dataset):
    """MNIST-shaped random images (1x28x28) with labels, the same on every process."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class DigitsDataModule(L.LightningDataModule):
    """The MNIST DataModule habit: ``prepare_data`` (once per node) and ``setup(stage)`` splits."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size, self.stages = batch_size, []

    def prepare_data(self):
        self.prepared = True  # downloads would go here: rank 0 only, Lightning's contract

    def setup(self, stage: str):
        self.stages.append(stage)
        if stage == "fit":
            self.train, self.val = Digits(64, 1), Digits(16, 2)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)


class LitAutoEncoder(L.LightningModule):
    """Lightning's README module: an ``nn.Sequential`` MLP encoder and decoder, no layer stack."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        loss = F.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        self.log("val_loss", F.mse_loss(self.decoder(self.encoder(x)), x), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


AUTOENCODER_PLAN = {"encoder.0": "column", "encoder.2": "row", "decoder.0": "column", "decoder.2": "row"}


def _autoencoder(plan):
    def run(args, workdir):
        return autoencoder(args, plan)

    return run


def autoencoder(args, plan):
    """No plan at tp2: refused, naming tp_plan; with a plan the user writes (the MLPs' Linear pairs), DDP's losses."""
    losses, data = StepLosses(), DigitsDataModule(8 // args.dp)
    t = trainer(args, [losses], plan=plan, max_steps=4, val_check_interval=4, limit_val_batches=2)
    t.fit(LitAutoEncoder(), datamodule=data)
    return {"losses": losses.losses, "val_loss": float(t.callback_metrics["val_loss"]), "stages": data.stages}


# ---------------------------------------------------------------- 2. callbacks
class _Recorded:
    """A model-summary callback as rank 0 prints it; the counts kept for the report."""

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, **kw):
        self.counts = {"total": total_parameters, "trainable": trainable_parameters,
                       "rows": {name: n for name, n in zip(summary_data[1][1], summary_data[3][1])}}
        return super().summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, **kw)


class RecordedSummary(_Recorded, ModelSummary):
    pass


class RecordedRichSummary(_Recorded, RichModelSummary):
    pass


def _summary(example_input: bool, kind=RecordedSummary):
    def run(args, workdir):
        """With ``example_input_array`` the summary also runs the model on it, for the in/out sizes."""
        summary_cb, losses, module = kind(max_depth=1), StepLosses(), GPT(batch_size=8 // args.dp)
        if example_input:
            module.example_input_array = torch.zeros(2, 8, dtype=torch.long)
        t = trainer(args, [summary_cb, losses], max_steps=2, limit_val_batches=0, enable_model_summary=True)
        t.fit(module)
        return {"losses": losses.losses, "counts": getattr(summary_cb, "counts", None)}

    return run


class Writer(BasePredictionWriter):
    """Lightning's documented writer: ``torch.save`` of the epoch's predictions and batch indices."""

    def __init__(self, path) -> None:
        super().__init__(write_interval="epoch")
        self.path = path

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        torch.save({"predictions": predictions, "batch_indices": batch_indices}, self.path / f"predictions_{trainer.global_rank}.pt")


def predict_writer(args, workdir):
    workdir.mkdir(parents=True, exist_ok=True)
    t = trainer(args, [Writer(workdir)])
    returned = t.predict(GPT(batch_size=4 // args.dp), return_predictions=True)
    written = torch.load(workdir / "predictions_0.pt")
    return {"returned": [p.tolist() for p in returned], "written": [p.tolist() for p in written["predictions"]],
            "batch_indices": written["batch_indices"]}


def lr_monitor_momentum(args, workdir):
    from lightning.pytorch.callbacks import LearningRateMonitor

    class Recorder(L.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, *a):
            self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lr-")})

    from lightning.pytorch.loggers import CSVLogger

    rec, losses = Recorder(), StepLosses()
    t = trainer(args, [LearningRateMonitor(logging_interval="step", log_momentum=True, log_weight_decay=True), losses, rec],
                max_steps=3, limit_val_batches=0, logger=CSVLogger(str(workdir)), log_every_n_steps=1)
    t.fit(GPT(batch_size=8 // args.dp))
    import csv

    rows = list(csv.DictReader(open(t.logger.experiment.metrics_file_path))) if t.global_rank == 0 else []
    return {"losses": losses.losses, "rows": [{k: v for k, v in r.items() if v} for r in rows]}


def throughput(args, workdir):
    """``ThroughputMonitor``'s logged columns, and its global rate over one device's (the replicas counted)."""
    import csv

    from lightning.pytorch.callbacks import ThroughputMonitor
    from lightning.pytorch.loggers import CSVLogger

    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch["input_ids"].shape[0], window_size=2)
    t = trainer(args, [monitor], max_steps=4, limit_val_batches=0, logger=CSVLogger(str(workdir)), log_every_n_steps=1)
    t.fit(GPT(batch_size=8 // args.dp))
    if t.global_rank != 0:
        return {}
    rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(open(t.logger.experiment.metrics_file_path))]
    last = [r for r in rows if "train/device/samples_per_sec" in r][-1]
    ratio = last["train/samples_per_sec"] / last["train/device/samples_per_sec"] if "train/samples_per_sec" in last else None
    return {"columns": sorted({k for r in rows for k in r if "/" in k}), "replicas": ratio, "samples": last["train/samples"]}


def timer(args, workdir):
    from lightning.pytorch.callbacks import Timer

    losses, clock = StepLosses(), Timer(duration="00:00:10:00")
    t = trainer(args, [losses, clock], max_steps=3, limit_val_batches=0)
    t.fit(GPT(batch_size=8 // args.dp))
    return {"losses": losses.losses, "elapsed_positive": clock.time_elapsed("train") > 0}


class FailingGPT(GPT):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("user error at step 2")
        return super().training_step(batch, batch_idx)


def on_exception_checkpoint(args, workdir):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    losses = StepLosses()
    t = trainer(args, [losses, OnExceptionCheckpoint(dirpath=str(workdir))], max_steps=4, limit_val_batches=0,
                enable_checkpointing=True)
    try:
        t.fit(FailingGPT(batch_size=8 // args.dp))
    except RuntimeError as error:
        raised = str(error)
    else:
        raised = None
    straight = StepLosses()
    if args.strategy == "ddp":  # DDP restarts the epoch's loader on resume; the strategy resumes exactly
        L.seed_everything(7, verbose=False)  # the failing run's start
        trainer(args, [straight], max_steps=4, limit_val_batches=0).fit(GPT(batch_size=8 // args.dp))
    resumed, after = GPT(batch_size=8 // args.dp), StepLosses()
    t = trainer(args, [after], max_steps=4, limit_val_batches=0)
    t.fit(resumed, ckpt_path=str(workdir / "on_exception.ckpt"))
    return {"losses": losses.losses + after.losses, "raised": raised, "global_step": t.global_step,
            "straight": straight.losses, "saved": (workdir / "on_exception.ckpt").exists()}


def pruning(args, workdir):
    from lightning.pytorch.callbacks import ModelPruning

    losses = StepLosses()
    t = trainer(args, [losses, ModelPruning("l1_unstructured", amount=0.5, verbose=0)], max_epochs=2, limit_train_batches=2,
                limit_val_batches=0)
    t.fit(GPT(batch_size=8 // args.dp))
    return {"losses": losses.losses}


def batch_size_finder(args, workdir):
    from lightning.pytorch.tuner import Tuner

    module = GPT(batch_size=2)
    t = trainer(args, max_epochs=1, default_root_dir=str(workdir))
    found = Tuner(t).scale_batch_size(module, mode="power", steps_per_trial=1, init_val=2, max_trials=3)
    return {"found": found, "batch_size": module.batch_size}


# ---------------------------------------------------------------- 3. module habits
class HabitGPT(GPT):
    """Module habits from tutorials, each switched on by name in ``habits``."""

    def __init__(self, habits: tuple, **kw) -> None:
        super().__init__(optimizer="sgd", **kw)
        self.habits, self.seen = habits, {}

    def on_fit_start(self):
        if "param-count" in self.habits:
            self.seen["param_count"] = sum(p.numel() for p in self.parameters())
            self.seen["trainable"] = sum(p.numel() for p in self.parameters() if p.requires_grad)
        if "stepping-batches" in self.habits:
            self.seen["estimated_stepping_batches"] = self.trainer.estimated_stepping_batches

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        if "strategy-reduce" in self.habits:
            reduced = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            self.seen.setdefault("reduced", []).append(float(reduced))
        if "self-print" in self.habits:
            self.print(f"step {batch_idx} loss {float(loss):.6f}")
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self):
        if "all-gather-log" in self.habits:
            gathered = self.all_gather(torch.tensor([float(self.global_step)], device=self.device))
            self.log("gathered_mean", gathered.float().mean())
            self.seen["gathered_shape"] = list(gathered.shape)

    def on_before_optimizer_step(self, optimizer):
        if "manual-clip" in self.habits:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.05)
            self.seen.setdefault("norms", []).append(float(norm))

    def configure_optimizers(self):
        if "no-decay" not in self.habits:
            return super().configure_optimizers()
        no_decay = ["bias", "LayerNorm.weight", "ln"]
        groups = [
            {"params": [p for n, p in self.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
            {"params": [p for n, p in self.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]
        self.seen["group_sizes"] = [sum(p.numel() for p in g["params"]) for g in groups]
        return torch.optim.AdamW(groups, lr=1e-2)


def _module_habit(*habits):
    def run(args, workdir):
        losses, module = StepLosses(), HabitGPT(habits, batch_size=8 // args.dp, n_train=32)
        t = trainer(args, [losses], max_epochs=1, limit_val_batches=0)
        t.fit(module)
        return {"losses": losses.losses, **module.seen,
                "logged": {k: float(v) for k, v in t.callback_metrics.items()}}

    return run


class ManualClipGPT(GPT):
    """Manual optimization with torch's clipping between ``manual_backward`` and ``opt.step()``."""

    def __init__(self, **kw) -> None:
        super().__init__(optimizer="sgd", **kw)
        self.automatic_optimization, self.norms = False, []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.compute_loss(batch)
        self.manual_backward(loss)
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.05)))
        opt.step()
        opt.zero_grad()
        self.log("train_loss", loss)
        return loss


def manual_clip_manual_optimization(args, workdir):
    losses, module = StepLosses(), ManualClipGPT(batch_size=8 // args.dp, n_train=32)
    trainer(args, [losses], max_steps=4, limit_val_batches=0).fit(module)
    return {"losses": losses.losses, "norms": module.norms}


def predict_structure(args, workdir):
    class Structured(GPT):
        def predict_step(self, batch, batch_idx):
            ids = batch["input_ids"]
            logits = self(ids[:, :-1])  # one pass: a pipeline runs the layer stack once per microbatch
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            return {"pred": logits.argmax(-1), "loss": loss}

    returned = trainer(args).predict(Structured(batch_size=4 // args.dp), return_predictions=True)
    return {"types": [type(r).__name__ for r in returned], "keys": [sorted(r) for r in returned],
            "pred": [r["pred"].tolist() for r in returned], "loss": [float(r["loss"]) for r in returned]}


HABITS = {
    "boring": boring,
    "autoencoder": _autoencoder(None),
    "autoencoder-plan": _autoencoder(AUTOENCODER_PLAN),
    "summary": _summary(False),
    "summary-example-input": _summary(True),
    "summary-rich": _summary(False, RecordedRichSummary),
    "predict-writer": predict_writer,
    "predict-structure": predict_structure,
    "lr-monitor-momentum": lr_monitor_momentum,
    "timer": timer,
    "throughput": throughput,
    "on-exception-checkpoint": on_exception_checkpoint,
    "pruning": pruning,
    "batch-size-finder": batch_size_finder,
    "manual-clip": _module_habit("manual-clip"),
    "manual-clip-manual-optimization": manual_clip_manual_optimization,
    "no-decay": _module_habit("no-decay"),
    "module-misc": _module_habit("param-count", "stepping-batches", "strategy-reduce", "self-print", "all-gather-log"),
}
