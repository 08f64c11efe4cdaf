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


def strategy(args):
    if args.strategy == "ddp":
        return DDPStrategy()
    from megastrategy import MegatronStrategy

    return MegatronStrategy(tp=args.tp, pp=args.pp, tp_plan=GPT.TP_PLAN if args.tp > 1 else None)


def trainer(args, callbacks=(), **kw) -> L.Trainer:
    """A quiet Trainer on all processes; ``kw`` overrides (max_steps, logger, checkpointing...)."""
    base = dict(accelerator="cpu", devices=args.devices, strategy=strategy(args), logger=False,
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
        losses = StepLosses()
        t = trainer(args, [losses], max_steps=3, limit_val_batches=0)
        t.fit(IterGPT(shard_by))
        return {"losses": losses.losses}

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
    t = trainer(args, max_steps=6, limit_val_batches=0)  # 2 optimizer steps per batch
    t.fit(module, DataLoader(TokenDataset(64), batch_size=8 // args.dp))
    return {"losses": [x for pair in module.record for x in pair]}


HABITS = {
    "iter-global-rank": _iterable("global_rank"),
    "iter-torch-distributed": _iterable("torch.distributed"),
    "iter-sampler-kwargs": _iterable("sampler_kwargs"),
    "iter-unsharded": _iterable("none"),
    "two-optimizers": two_optimizers,
}
