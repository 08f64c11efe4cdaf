"""Round-3 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Each builds a fresh tiny module and Trainer, on ``DDPStrategy`` or ``MegatronStrategy(tp, pp)``
as ``args`` say (tests/scripts/habits_round3.py runs several in one launch), and returns what
the test compares with DDP: per-step losses and whatever else the habit decides.
"""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, IterableDataset

from tests.helpers.models import GPT, TokenDataset, VOCAB


def strategy(args, plan=GPT.TP_PLAN, **ddp):
    if args.strategy == "ddp":
        return DDPStrategy(**ddp)
    from megastrategy import MegatronStrategy

    return MegatronStrategy(tp=args.tp, pp=args.pp, tp_plan=plan if args.tp > 1 else None)


def trainer(args, callbacks=(), ddp=None, plan=GPT.TP_PLAN, **kw) -> L.Trainer:
    """A quiet Trainer on all processes; ``kw`` overrides (max_steps, logger, checkpointing...),
    ``ddp`` are DDPStrategy's keywords, ``plan`` the tp_plan (the GPT's by default)."""
    base = dict(accelerator="cpu", devices=args.devices, strategy=strategy(args, plan, **(ddp or {})), logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=2)
    base.update(kw)
    return L.Trainer(callbacks=list(callbacks), **base)


class StepLosses(L.Callback):
    """Each training batch's loss as ``on_train_batch_end`` sees it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


# ---------------------------------------------------------------- 1. IterableDataset sharding
class ShardedTokens(IterableDataset):
    """TokenDataset rows ``i`` with ``i % num == rank``; ``(rank, num)`` asked at iteration time."""

    def __init__(self, n: int, shard) -> None:
        self.rows, self.shard = TokenDataset(n), shard

    def __iter__(self):
        rank, num = self.shard()
        return (self.rows[i] for i in range(len(self.rows)) if i % num == rank)


class IterGPT(GPT):
    def __init__(self, shard_by: str) -> None:
        super().__init__(batch_size=8)
        self.shard_by = shard_by

    def _shard(self):
        if self.shard_by == "global_rank":
            return self.trainer.global_rank, self.trainer.world_size
        if self.shard_by == "torch.distributed":
            return dist.get_rank(), dist.get_world_size()
        if self.shard_by == "sampler_kwargs":
            kw = self.trainer.strategy.distributed_sampler_kwargs
            return kw["rank"], kw["num_replicas"]
        return 0, 1

    def train_dataloader(self):
        return DataLoader(ShardedTokens(64, self._shard), batch_size=self.batch_size)


def _iterable(shard_by):
    def run(args, workdir):
        import warnings

        losses = StepLosses()
        t = trainer(args, [losses], max_steps=3, limit_val_batches=0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            t.fit(IterGPT(shard_by))
        return {"losses": losses.losses, "warnings": [str(w.message) for w in seen if "IterableDataset" in str(w.message)]}

    return run


# ---------------------------------------------------------------- 2. two optimizers, manual
class TwoOptimizerGPT(GPT):
    """GAN-like: the GPT (generator) and a small critic on its hidden states, each with its optimizer,
    toggled as Lightning's GAN example does; two ``opt.step()`` per batch."""

    def __init__(self) -> None:
        super().__init__(batch_size=8)
        self.automatic_optimization = False
        self.critic = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.record: list[list[float]] = []

    def hidden(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        ids = batch["input_ids"]
        self.toggle_optimizer(opt_g)
        h = self.hidden(ids[:, :-1])
        lm = F.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        g_loss = lm + 0.1 * self.critic(h).mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        with torch.no_grad():
            h = self.hidden(ids[:, :-1])
        d_loss = (self.critic(h) - 1).pow(2).mean()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.record.append([float(g_loss), float(d_loss)])

    def configure_optimizers(self):
        gen = [p for n, p in self.named_parameters() if not n.startswith("critic.")]
        return torch.optim.SGD(gen, lr=0.5), torch.optim.SGD(self.critic.parameters(), lr=0.5)


def two_optimizers(args, workdir):
    module = TwoOptimizerGPT()
    t = trainer(args, ddp={"find_unused_parameters": True}, max_steps=6, limit_val_batches=0)  # 2 optimizer steps per batch
    t.fit(module, DataLoader(TokenDataset(64), batch_size=8 // args.dp))
    return {"losses": [x for pair in module.record for x in pair]}


# ---------------------------------------------------------------- 3. accumulation schedule
def accumulation_schedule(args, workdir):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    losses = StepLosses()
    t = trainer(args, [losses, GradientAccumulationScheduler(scheduling={0: 1, 1: 2})], max_epochs=2, limit_val_batches=0)
    t.fit(GPT(batch_size=8 // args.dp, n_train=32))
    return {"losses": losses.losses, "global_step": t.global_step}


# ---------------------------------------------------------------- 4. save_last, resume from "last"
def resume_last(args, workdir):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps, ckpt_path=None):
        losses = StepLosses()
        every = ModelCheckpoint(dirpath=workdir / "ckpt", save_last=True, every_n_train_steps=2)
        t = trainer(args, [losses, every], max_steps=max_steps, enable_checkpointing=True, limit_val_batches=0)
        t.fit(GPT(batch_size=8 // args.dp), ckpt_path=ckpt_path)
        return losses.losses, t.global_step

    if getattr(args, "straight", False):
        return {"losses": run(7)[0]}
    first, _ = run(4)
    resumed, step = run(7, ckpt_path="last")
    return {"losses": first + resumed, "global_step": step, "files": sorted(p.name for p in (workdir / "ckpt").iterdir())}


# ---------------------------------------------------------------- 5. a dict of training loaders
class DictLoadersGPT(GPT):
    """``{"a": ..., "b": ...}`` training loaders (CombinedLoader, "max_size_cycle"); the step runs the
    model on each batch (``joined=False``) or once on both joined along the batch (``joined=True``)."""

    def __init__(self, joined: bool, **kw) -> None:
        super().__init__(**kw)
        self.joined = joined

    def train_dataloader(self):
        return {"a": DataLoader(TokenDataset(32), batch_size=self.batch_size),
                "b": DataLoader(TokenDataset(16, seed=3), batch_size=self.batch_size)}

    def training_step(self, batch, batch_idx):
        if self.joined:
            loss = self.compute_loss({"input_ids": torch.cat([batch["a"]["input_ids"], batch["b"]["input_ids"]])})
        else:
            loss = self.compute_loss(batch["a"]) + 0.5 * self.compute_loss(batch["b"])
        self.log("train_loss", loss)
        return loss


def _dict_loaders(joined):
    def run(args, workdir):
        losses = StepLosses()
        t = trainer(args, [losses], max_steps=5, limit_val_batches=0)
        t.fit(DictLoadersGPT(joined, batch_size=8 // args.dp))
        return {"losses": losses.losses}

    return run


# ---------------------------------------------------------------- 6. BatchNorm
class Images(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class ConvNet(L.LightningModule):
    """A small conv net with BatchNorm: its running statistics are buffers, updated by each forward."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        nn = torch.nn
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Images(64), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(Images(32, seed=4), batch_size=self.batch_size)


def _batch_norm(accumulate: int):
    def run(args, workdir):
        return batch_norm(args, accumulate)

    return run


def batch_norm(args, accumulate: int):
    """Rank 0's checkpointed statistics and every rank's validation statistics follow rank 0 under
    DDP (``broadcast_buffers``); the report holds every rank's buffers after fit."""
    losses, module = StepLosses(), ConvNet(8 // args.dp)
    t = trainer(args, [losses], plan=None, max_steps=4, val_check_interval=2 * accumulate, limit_val_batches=2,
                accumulate_grad_batches=accumulate)
    t.fit(module)
    stats = {n: b.tolist() for n, b in module.named_buffers() if "running" in n}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, stats)
    return {"losses": losses.losses, "val_loss": float(t.callback_metrics["val_loss"]), "buffers": every}


# ---------------------------------------------------------------- 7. SWA, a user-kept EMA
def swa(args, workdir):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    losses, module = StepLosses(), GPT(batch_size=8 // args.dp, n_train=32)
    t = trainer(args, [losses, StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)], max_epochs=3, limit_val_batches=2)
    t.fit(module)
    return {"losses": losses.losses, "val_after": t.validate(module, verbose=False)}


def swa_resume(args, workdir):
    """SWA, checkpointed every 4 steps (each epoch's end), resumed from "last" after 2 epochs."""
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging

    def run(max_epochs, ckpt_path=None):
        losses, module = StepLosses(), GPT(batch_size=8 // args.dp, n_train=32)
        every = ModelCheckpoint(dirpath=workdir / "ckpt", save_last=True, every_n_train_steps=4)
        t = trainer(args, [losses, every, StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)],
                    max_epochs=max_epochs, enable_checkpointing=True, limit_val_batches=2)
        t.fit(module, ckpt_path=ckpt_path)
        return losses.losses, t.validate(module, verbose=False)

    first, _ = run(2)
    resumed, val = run(3, ckpt_path="last")
    return {"losses": first + resumed, "val_after": val}


class EmaGPT(GPT):
    """Keeps an exponential moving average of its blocks, made in ``__init__`` (``when="init"``) or
    in ``on_fit_start``, updated after every batch; validates with the averaged blocks after fit."""

    def __init__(self, when: str, **kw) -> None:
        super().__init__(**kw)
        self.when = when
        if when == "init":
            self.ema = self._average()

    def _average(self):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        return AveragedModel(self.blocks, multi_avg_fn=get_ema_multi_avg_fn(0.5)).requires_grad_(False)

    def configure_optimizers(self):
        """The model's own parameters (the EMA's may exist already: resumed). SGD: Adam would blow the
        rounding noise of a gradient that is zero in exact arithmetic (a key's bias) up to lr."""
        return torch.optim.SGD([p for n, p in self.named_parameters() if not n.startswith("ema.")], lr=0.05)

    def on_fit_start(self):
        if self.when == "fit_start" and not hasattr(self, "ema"):  # resumed: made by on_load_checkpoint
            self.ema = self._average()

    def on_load_checkpoint(self, checkpoint):
        """The saved average must find its module to load into (DDP's strict loading, too)."""
        if self.when == "fit_start" and not hasattr(self, "ema"):
            self.ema = self._average()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.update_parameters(self.blocks)

    def on_train_end(self):
        with torch.no_grad():
            for mine, averaged in zip(self.blocks.parameters(), self.ema.module.parameters()):
                mine.copy_(averaged)


def _ema(when):
    def run(args, workdir):
        losses, module = StepLosses(), EmaGPT(when, batch_size=8 // args.dp)
        t = trainer(args, [losses], max_steps=4, limit_val_batches=2)
        t.fit(module)
        return {"losses": losses.losses, "val_after": t.validate(module, verbose=False)}

    return run


def ema_saved(args, workdir):
    """An EMA built in ``on_fit_start`` is part of the module's state: the checkpoint holds it whole
    (consolidated like the parameters it averages); ``fit(ckpt_path=...)`` continues it."""
    losses, module = StepLosses(), EmaGPT("fit_start", batch_size=8 // args.dp, n_train=16)
    t = trainer(args, [losses], max_steps=2, limit_val_batches=0)  # one epoch: DDP resumes at the next
    t.fit(module)
    path = str(workdir / "ema.ckpt")
    t.save_checkpoint(path)
    resumed = EmaGPT("fit_start", batch_size=8 // args.dp, n_train=16)
    t = trainer(args, [losses], max_steps=4, limit_val_batches=0)
    t.fit(resumed, ckpt_path=path)
    t.save_checkpoint(str(workdir / "ema-resumed.ckpt"))
    return {"losses": losses.losses, "ckpt": path, "resumed_ckpt": str(workdir / "ema-resumed.ckpt")}


# ---------------------------------------------------------------- 8. the learning-rate finder
def lr_find(args, workdir):
    from lightning.pytorch.tuner import Tuner

    t = trainer(args, max_epochs=1, default_root_dir=str(workdir))
    found = Tuner(t).lr_find(GPT(batch_size=8 // args.dp), min_lr=1e-4, max_lr=1.0, num_training=8, early_stop_threshold=None)
    return {"losses": [float(x) for x in found.results["loss"]], "suggestion": found.suggestion()}


HABITS = {
    "iter-global-rank": _iterable("global_rank"),
    "iter-torch-distributed": _iterable("torch.distributed"),
    "iter-sampler-kwargs": _iterable("sampler_kwargs"),
    "iter-unsharded": _iterable("none"),
    "two-optimizers": two_optimizers,
    "accumulation-schedule": accumulation_schedule,
    "resume-last": resume_last,
    "straight-7": lambda args, workdir: resume_last(type(args)(**vars(args), straight=True), workdir),
    "dict-loaders": _dict_loaders(False),
    "dict-loaders-joined": _dict_loaders(True),
    "swa": swa,
    "swa-resume": swa_resume,
    "ema-init": _ema("init"),
    "ema-fit-start": _ema("fit_start"),
    "lr-find": lr_find,
    "ema-saved": ema_saved,
    "batch-norm": _batch_norm(1),
    "batch-norm-accumulate": _batch_norm(2),
}
