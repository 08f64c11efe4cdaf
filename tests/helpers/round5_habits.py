"""Round-5 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Trainer flags users set without thinking of the strategy (``fast_dev_run``, ``overfit_batches``,
profilers, ``detect_anomaly``...) and DataModule / batch-transfer hooks, each on a fresh Trainer
(``tests/helpers/round3_habits.trainer``); tests/scripts/habits_round5.py runs several in one launch.
A report holds per-step losses and what rank 0 logged, wrote, counted or returned.
"""
from __future__ import annotations

import dataclasses

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from torch.utils.data import DataLoader

from tests.helpers.models import GPT, TokenDataset
from tests.helpers.round3_habits import StepLosses, trainer


def _metrics(t: L.Trainer) -> dict:
    return {k: float(v) for k, v in t.callback_metrics.items()}


class Counted(GPT):
    """Counts the loop's hooks, to compare how often each ran with one device's run."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: dict = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def training_step(self, batch, batch_idx):
        self._count("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self._count("validation_step")
        return super().validation_step(batch, batch_idx)

    def train_dataloader(self):
        self._count("train_dataloader")
        return super().train_dataloader()

    def val_dataloader(self):
        self._count("val_dataloader")
        return super().val_dataloader()


# ---------------------------------------------------------------- 1. Trainer flags
def _flags(module_kw: dict = None, **flags):
    """Fit a ``Counted`` GPT with Trainer ``flags``: losses, hook counts, what was logged."""

    def run(args, workdir):
        losses, module = StepLosses(), Counted(batch_size=8 // args.dp, n_train=32, **(module_kw or {}))
        base = dict(max_epochs=1, limit_val_batches=2)
        base.update(flags)
        t = trainer(args, [losses], **base)
        t.fit(module)
        return {"losses": losses.losses, "calls": module.calls, "logged": _metrics(t), "global_step": t.global_step}

    return run


def _profiler(kind: str):
    def run(args, workdir):
        losses = StepLosses()
        t = trainer(args, [losses], max_steps=3, limit_val_batches=2, profiler=kind, default_root_dir=str(workdir))
        t.fit(GPT(batch_size=8 // args.dp))
        p = t.profiler
        if kind != "simple":  # the advanced profiler's cProfile tables are printed, not kept
            return {"losses": losses.losses}
        actions = {a.replace(type(t.strategy).__name__, "Strategy"): len(v) for a, v in p.recorded_durations.items()}
        return {"losses": losses.losses, "actions": {a: n for a, n in actions.items() if "batch" in a or "step" in a}}

    return run


class NanGPT(GPT):
    """A ``sqrt`` of a negative in the second step: ``detect_anomaly`` names the backward that made NaN."""

    def compute_loss(self, batch):
        loss = super().compute_loss(batch)
        if self.training and self.global_step == 1:
            loss = loss + torch.sqrt(loss - 1e3)
        return loss


def detect_anomaly_nan(args, workdir):
    """The NaN named by the backward that made it (under pp the stage that runs it raises, and the
    watchdog stops the others: a launch of its own)."""
    try:
        trainer(args, max_steps=3, limit_val_batches=0, detect_anomaly=True).fit(NanGPT(batch_size=8 // args.dp))
        raised = None
    except RuntimeError as error:
        raised = str(error)
    return {"raised": raised}


# ---------------------------------------------------------------- 2. DataModule and batch hooks
class TokenData(L.LightningDataModule):
    """A DataModule with ``setup(stage)``, state saved in checkpoints, and the three transfer hooks."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size, self.stages, self.hooks, self.epochs_seen = batch_size, [], {}, 0
        self.loaded_state = None

    def setup(self, stage: str):
        self.stages.append(stage)

    def train_dataloader(self):
        return DataLoader(TokenDataset(32), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TokenDataset(16, seed=99), batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(TokenDataset(16, seed=5), batch_size=self.batch_size)

    def predict_dataloader(self):
        return self.test_dataloader()

    def _count(self, name):
        self.hooks[name] = self.hooks.get(name, 0) + 1

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self._count("on_before_batch_transfer")
        batch["input_ids"] = batch["input_ids"].clone()
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self._count("transfer_batch_to_device")
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self._count("on_after_batch_transfer")
        if self.trainer is not None and self.trainer.training:  # a GPU augmentation: random token dropout
            ids = batch["input_ids"]
            keep = torch.rand(ids.shape, device=ids.device) > 0.1
            batch["input_ids"] = torch.where(keep, ids, torch.zeros_like(ids))
        return batch

    def state_dict(self):
        return {"epochs_seen": self.epochs_seen}

    def load_state_dict(self, state):
        self.loaded_state = dict(state)


class DataAware(GPT):
    """Reads ``self.trainer.datamodule`` in the step, as tutorials do for the batch size or classes."""

    def training_step(self, batch, batch_idx):
        self.log("dm_batch_size", float(self.trainer.datamodule.batch_size))
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        self.trainer.datamodule.epochs_seen += 1


def datamodule_hooks(args, workdir):
    """Transfer hooks called once per batch (and every rank's random augmentation made one), the
    DataModule's state saved in the checkpoint and given back on resume, ``setup`` per stage."""
    losses, data = StepLosses(), TokenData(8 // args.dp)
    t = trainer(args, [losses], max_epochs=1, limit_val_batches=2, enable_checkpointing=True, default_root_dir=str(workdir))
    t.fit(DataAware(batch_size=8 // args.dp), datamodule=data)
    path = workdir / "dm.ckpt"
    t.save_checkpoint(str(path))
    hooks = dict(data.hooks)
    import torch.distributed as dist

    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, hooks)  # the hooks run on every rank, before the batch broadcast
    saved = torch.load(path, weights_only=False).get("TokenData") if path.is_file() else "sharded"
    resumed_data = TokenData(8 // args.dp)
    t2 = trainer(args, max_epochs=2, limit_val_batches=0, limit_train_batches=1)
    module = DataAware(batch_size=8 // args.dp)
    t2.fit(module, datamodule=resumed_data, ckpt_path=str(path))
    t2.test(module, datamodule=resumed_data, verbose=False)
    return {"losses": losses.losses, "hooks": hooks, "every_rank": every_rank, "saved": saved, "loaded": resumed_data.loaded_state,
            "stages": data.stages, "resumed_stages": resumed_data.stages, "logged": _metrics(t)}


# ---------------------------------------------------------------- 3. after fit
def test_best(args, workdir):
    """``trainer.test(ckpt_path="best")`` after ``ModelCheckpoint(monitor="val_loss")`` picked the best epoch."""
    losses = StepLosses()
    best = ModelCheckpoint(dirpath=str(workdir), monitor="val_loss", save_top_k=1)
    t = trainer(args, [losses, best], max_epochs=3, limit_train_batches=2, limit_val_batches=2, enable_checkpointing=True)
    module = GPT(batch_size=8 // args.dp)
    t.fit(module)
    tested = t.test(module, ckpt_path="best", verbose=False)
    from pathlib import Path

    return {"losses": losses.losses, "best": Path(best.best_model_path).name, "best_score": float(best.best_model_score),
            "tested": tested}


class BatchWriter(BasePredictionWriter):
    """A writer per batch, used with ``return_predictions=False`` as Lightning's docs show for big outputs."""

    def __init__(self, path) -> None:
        super().__init__(write_interval="batch")
        self.path = path

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        torch.save({"prediction": prediction, "batch_indices": batch_indices},
                   self.path / f"batch{batch_idx}_rank{trainer.global_rank}.pt")


def predict_no_return(args, workdir):
    workdir.mkdir(parents=True, exist_ok=True)
    returned = trainer(args, [BatchWriter(workdir)]).predict(GPT(batch_size=4 // args.dp), return_predictions=False)
    files = sorted(p.name for p in workdir.iterdir() if p.name.endswith("_rank0.pt"))
    written = [torch.load(workdir / f) for f in files]
    return {"returned": returned, "files": files, "written": [w["prediction"].tolist() for w in written],
            "batch_indices": [w["batch_indices"] for w in written]}


HABITS = {
    "fast-dev-run": _flags(fast_dev_run=True),
    "fast-dev-run-3": _flags(fast_dev_run=3),
    "overfit-batches": _flags(overfit_batches=2, max_epochs=3),
    "limit-train-half": _flags(limit_train_batches=0.5),
    "deterministic": _flags(deterministic=True, max_steps=3),
    "sanity-all": _flags(num_sanity_val_steps=-1, max_steps=2),
    "no-inference-mode": _flags(inference_mode=False, max_steps=2, val_check_interval=2),
    "barebones": _flags(barebones=True, max_steps=3, limit_val_batches=0),
    "reload-loaders": _flags(reload_dataloaders_every_n_epochs=1, max_epochs=2, limit_train_batches=2),
    "val-every-2-epochs": _flags(check_val_every_n_epoch=2, max_epochs=2, limit_train_batches=2),
    "profiler-simple": _profiler("simple"),
    "profiler-advanced": _profiler("advanced"),
    "detect-anomaly": _flags(detect_anomaly=True, max_steps=3),
    "detect-anomaly-nan": detect_anomaly_nan,
    "datamodule-hooks": datamodule_hooks,
    "test-best": test_best,
    "predict-no-return": predict_no_return,
}


# ---------------------------------------------------------------- 4. sync_batchnorm
class BatchNormGPT(GPT):
    """A BatchNorm over the features before the head; records what its layer became for training."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.bn = torch.nn.BatchNorm1d(32)
        self.seen: dict = {}

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(self.bn(x.transpose(1, 2)).transpose(1, 2)))

    def on_train_start(self):
        import torch.distributed as dist

        group = getattr(self.bn, "process_group", None) or dist.group.WORLD
        self.seen = {"layer": type(self.bn).__name__, "group_size": dist.get_world_size(group)}


def sync_batchnorm(args, workdir):
    """On CPU torch's SyncBatchNorm refuses to run (GPU only): the same ValueError as DDP's shows the
    layer was converted, ``group_size`` over which processes it would sync."""
    module, losses = BatchNormGPT(batch_size=8 // args.dp), StepLosses()
    t = trainer(args, [losses], max_steps=2, limit_val_batches=0, sync_batchnorm=True)
    try:
        t.fit(module)
        raised = None
    except ValueError as error:
        raised = str(error)
    return {"losses": losses.losses, "raised": raised, **module.seen, "after": type(module.bn).__name__}


HABITS["sync-batchnorm"] = sync_batchnorm


# ---------------------------------------------------------------- 5. a custom batch class
class TokenBatch:
    """Lightning's documented ``CustomBatch``: a plain class the collate function builds, moved by the
    user's ``transfer_batch_to_device``."""

    def __init__(self, rows) -> None:
        self.input_ids = torch.stack([r["input_ids"] for r in rows])

    def __len__(self):
        return len(self.input_ids)


class CustomBatchGPT(GPT):
    def train_dataloader(self):
        return DataLoader(TokenDataset(32), batch_size=self.batch_size, collate_fn=TokenBatch)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if isinstance(batch, TokenBatch):
            batch.input_ids = batch.input_ids.to(device)
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def compute_loss(self, batch):
        return super().compute_loss({"input_ids": batch.input_ids} if isinstance(batch, TokenBatch) else batch)


@dataclasses.dataclass
class TokenFields:
    """The same batch as a dataclass, which Lightning's ``apply_to_collection`` moves field by field."""

    input_ids: torch.Tensor
    source: str = "tokens"


class DataclassBatchGPT(GPT):
    def train_dataloader(self):
        collate = lambda rows: TokenFields(torch.stack([r["input_ids"] for r in rows]))  # noqa: E731
        return DataLoader(TokenDataset(32), batch_size=self.batch_size, collate_fn=collate)

    def compute_loss(self, batch):
        assert isinstance(batch, TokenFields) and batch.source == "tokens", type(batch)
        return super().compute_loss({"input_ids": batch.input_ids})


def _batch_class(kind, **strategy):
    def run(args, workdir):
        losses = StepLosses()
        trainer(args, [losses], max_steps=3, limit_val_batches=0, **strategy).fit(kind(batch_size=8 // args.dp))
        return {"losses": losses.losses}

    return run


HABITS["custom-batch"] = _batch_class(CustomBatchGPT)
HABITS["dataclass-batch"] = _batch_class(DataclassBatchGPT)


# ---------------------------------------------------------------- 6. max_time
class SlowGPT(GPT):
    def training_step(self, batch, batch_idx):
        import time

        time.sleep(0.2)
        return super().training_step(batch, batch_idx)


def max_time(args, workdir):
    """``max_time`` stops by each rank's own clock; Lightning's Timer broadcasts rank 0's decision, so
    every rank stops after the same step (a disagreement would hang the next collective)."""
    losses = StepLosses()
    t = trainer(args, [losses], max_time={"seconds": 2}, max_epochs=50, limit_val_batches=0)
    t.fit(SlowGPT(batch_size=8 // args.dp))
    steps = t.strategy.reduce(torch.tensor(float(t.global_step)), reduce_op="max")
    return {"losses": losses.losses, "global_step": t.global_step, "max_global_step": int(steps)}


HABITS["max-time"] = max_time
