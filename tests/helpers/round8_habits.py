"""Round-8 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Habits of ordinary modules not tried in rounds 1-7: ``torch.nn.utils.parametrize`` on sharded layers
(``weight_norm``, ``spectral_norm``), a user's block around ``nn.MultiheadAttention`` and torch's
``nn.Transformer`` encoder-decoder, ``save_hyperparameters`` with a ``CSVLogger`` and a
``ModelCheckpoint`` naming files by step and metric, ``ModelCheckpoint``/``EarlyStopping`` on the
training loss, a cosine warm-up schedule over ``estimated_stepping_batches`` with an accumulation that
does not divide the epoch, ``no_grad`` inference on a fixed sample at an epoch's end, a pre-batched
``DataLoader(batch_size=None)``, ``WeightedRandomSampler``, augmentation in seeded workers,
``self.log`` from the backward and optimizer hooks, a penalty over ``self.parameters()`` in the loss, and
weights re-initialized in ``on_fit_start``. Each on fresh Trainers
(``tests/helpers/round3_habits.trainer``); tests/scripts/habits_round8.py runs several in one launch.
"""
from __future__ import annotations

import csv

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from tests.helpers.models import GPT, SEQ, VOCAB, TokenDataset
from tests.helpers.round3_habits import StepLosses, trainer
from tests.helpers.round7_habits import _raised


# ---------------------------------------------------------------- 1. torch.nn.utils.parametrize on sharded Linears
def _parametrized(which: str, kind: str, plan: dict = GPT.TP_PLAN):
    """A GPT whose blocks' ``which`` Linear (``fc``: column-sharded, ``out``: row-sharded) is
    reparametrized by ``torch.nn.utils.parametrizations.<kind>``, as a user adds it after building."""

    class Parametrized(GPT):
        def __init__(self, **kw):
            super().__init__(**kw)
            norm = getattr(torch.nn.utils.parametrizations, kind)
            for block in self.blocks:
                norm(getattr(block, which))

    def run(args, workdir):
        losses = StepLosses()
        t = trainer(args, [losses], plan=plan, max_steps=4, limit_val_batches=0)
        _, raised = _raised(lambda: t.fit(Parametrized(batch_size=8 // args.dp)))
        return {"losses": losses.losses, "raised": raised}

    return run


HABITS = {
    "weight-norm-column": _parametrized("fc", "weight_norm"),
    "weight-norm-row": _parametrized("out", "weight_norm"),
    "spectral-norm-column": _parametrized("fc", "spectral_norm"),
    # the route the refusal names: the reparametrized layer and its row partner kept whole
    "weight-norm-replicated": _parametrized("fc", "weight_norm", {**GPT.TP_PLAN, "blocks.*.fc": "replicate",
                                                                  "blocks.*.out": "replicate"}),
    "spectral-norm-replicated": _parametrized("fc", "spectral_norm", {**GPT.TP_PLAN, "blocks.*.fc": "replicate",
                                                                      "blocks.*.out": "replicate"}),
}


# ---------------------------------------------------------------- 2. torch's attention modules in a user's model
class MHABlock(nn.Module):
    """A pre-norm block written around ``nn.MultiheadAttention`` (fused ``in_proj_weight``)."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHAGPT(GPT):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.blocks = nn.ModuleList(MHABlock(32, 4) for _ in range(2))


class TorchSeq2Seq(GPT):
    """``nn.Transformer`` (encoder-decoder) copying a sequence shifted: the decoder reads the target
    with a causal mask and attends to the encoder's memory."""

    def __init__(self, **kw):
        super().__init__(**kw)
        del self.blocks, self.ln_f
        self.transformer = nn.Transformer(32, 4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                                          dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        pos = self.wpe(torch.arange(tgt.shape[1], device=tgt.device))
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(self.wte(src) + self.wpe(torch.arange(src.shape[1])), self.wte(tgt) + pos,
                             tgt_mask=mask, tgt_is_causal=True)
        return self.lm_head(h)

    def compute_loss(self, batch):
        ids = batch["input_ids"]
        logits = self(ids.flip(1), ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _torch_attention(kind):
    def run(args, workdir):
        losses = StepLosses()
        t = trainer(args, [losses], plan=None, max_epochs=1, limit_train_batches=4, limit_val_batches=2)
        _, raised = _raised(lambda: t.fit(kind(batch_size=8 // args.dp)))
        return {"losses": losses.losses, "raised": raised,
                "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}

    return run


HABITS["mha-block"] = _torch_attention(MHAGPT)
HABITS["nn-transformer"] = _torch_attention(TorchSeq2Seq)


# ---------------------------------------------------------------- 3. hparams, a CSVLogger and checkpoint file names
class HparamsGPT(GPT):
    def __init__(self, batch_size: int = 4, lr: float = 1e-3, warmup: int = 2, tag: str = "run-a"):
        super().__init__(batch_size=batch_size, lr=lr)
        self.save_hyperparameters()


def _checkpoint_reads(path: str, strategy: str) -> dict:
    if strategy == "ddp":
        return torch.load(path, weights_only=False)
    from megastrategy.checkpoint import consolidate_lightning

    return consolidate_lightning(path)


def hparams_and_checkpoint_names(args, workdir):
    """``save_hyperparameters()``, a ``CSVLogger`` (its ``hparams.yaml``), and ``ModelCheckpoint(
    every_n_train_steps=2, save_top_k=-1, save_last=True, filename="{epoch}-{step}-{val_loss:.4f}")``."""
    from lightning.pytorch.loggers import CSVLogger

    losses = StepLosses()
    ckpt = ModelCheckpoint(dirpath=str(workdir / "ckpt"), every_n_train_steps=2, save_top_k=-1, save_last=True,
                           filename="{epoch}-{step}-{val_loss:.4f}")
    t = trainer(args, [losses, ckpt], max_epochs=2, limit_train_batches=4, limit_val_batches=2,
                enable_checkpointing=True, logger=CSVLogger(str(workdir), name="csv", version=0), log_every_n_steps=1)
    t.fit(HparamsGPT(batch_size=8 // args.dp, tag="b"))
    report = {"losses": losses.losses}
    if t.global_rank == 0:
        names = sorted(p.name.removesuffix(".ckpt") for p in (workdir / "ckpt").iterdir())
        last = _checkpoint_reads(ckpt.last_model_path, args.strategy)
        report.update(names=names, hparams=dict(last["hyper_parameters"]),
                      yaml=(workdir / "csv" / "version_0" / "hparams.yaml").read_text(),
                      rows=_csv_rows(t.logger.experiment.metrics_file_path))
    return report


def _csv_rows(path) -> list:
    return [{k: v for k, v in r.items() if v} for r in csv.DictReader(open(path))]


HABITS["hparams-checkpoint-names"] = hparams_and_checkpoint_names


def monitor_train_loss(args, workdir):
    """``ModelCheckpoint(monitor="train_loss", save_top_k=2)`` and ``EarlyStopping(monitor="train_loss",
    patience=1, min_delta=1.0, check_on_train_epoch_end=True)``: the kept files, best score and the
    epoch it stopped at."""
    losses = StepLosses()
    ckpt = ModelCheckpoint(dirpath=str(workdir / "ckpt"), monitor="train_loss", save_top_k=2, mode="min",
                           filename="{epoch}-{train_loss:.3f}")
    stop = EarlyStopping(monitor="train_loss", patience=1, min_delta=1.0, check_on_train_epoch_end=True)
    module = GPT(batch_size=8 // args.dp, lr=3e-3)
    t = trainer(args, [losses, ckpt, stop], max_epochs=8, limit_train_batches=2, limit_val_batches=0,
                enable_checkpointing=True)
    t.fit(module)
    return {"losses": losses.losses, "stopped_epoch": stop.stopped_epoch, "best": float(ckpt.best_model_score),
            "kept": sorted(p.name for p in (workdir / "ckpt").iterdir()) if t.global_rank == 0 else None}


HABITS["monitor-train-loss"] = monitor_train_loss


# ---------------------------------------------------------------- 4. a warm-up schedule over estimated_stepping_batches
class CosineWarmup(GPT):
    def configure_optimizers(self):
        from transformers import get_cosine_schedule_with_warmup

        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = get_cosine_schedule_with_warmup(opt, 2, self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StepLrs(L.Callback):
    """The lr each optimizer step ran with, and how many steps there were."""

    def __init__(self) -> None:
        self.lrs: list = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


def cosine_warmup_accumulation(args, workdir):
    """``get_cosine_schedule_with_warmup(opt, 2, estimated_stepping_batches)`` with
    ``accumulate_grad_batches=3`` over 7 batches an epoch (the last accumulation is partial)."""
    losses, lrs = StepLosses(), StepLrs()
    t = trainer(args, [losses, lrs], max_epochs=2, limit_train_batches=7, limit_val_batches=0,
                accumulate_grad_batches=3)
    t.fit(CosineWarmup(batch_size=8 // args.dp))
    return {"losses": losses.losses, "lrs": lrs.lrs, "stepping": t.estimated_stepping_batches,
            "global_step": t.global_step}


HABITS["cosine-warmup-accumulation"] = cosine_warmup_accumulation


# ---------------------------------------------------------------- 5. no_grad inference on a fixed sample at epoch ends
class SampleAtEpochEnd(GPT):
    """The model run on a fixed sample outside any step, under ``torch.no_grad()``, at the end of each
    training and validation epoch, its mean logit logged (a quick quality probe)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("sample", TokenDataset(2, seed=5).ids, persistent=False)
        self.probes: list = []

    def _probe(self, name):
        with torch.no_grad():
            value = self(self.sample).float().mean()
        self.probes.append(float(value))
        self.log(name, value)

    def on_train_epoch_end(self):
        self._probe("train_probe")

    def on_validation_epoch_end(self):
        self._probe("val_probe")


def sample_at_epoch_end(args, workdir):
    losses, module = StepLosses(), SampleAtEpochEnd(batch_size=8 // args.dp)
    t = trainer(args, [losses], max_epochs=2, limit_train_batches=2, limit_val_batches=1)
    _, raised = _raised(lambda: t.fit(module))
    return {"losses": losses.losses, "probes": module.probes, "raised": raised,
            "logged": {k: float(v) for k, v in t.callback_metrics.items() if "probe" in k}}


HABITS["sample-at-epoch-end"] = sample_at_epoch_end


# ---------------------------------------------------------------- 6. data loading habits
class PreBatched(Dataset):
    """Each item is already a batch (a dict of ``[rows, SEQ]`` tensors): ``DataLoader(batch_size=None)``."""

    def __init__(self, rows: int) -> None:
        self.rows = TokenDataset(64)
        self.per = rows

    def __len__(self):
        return len(self.rows) // self.per

    def __getitem__(self, i):
        s = slice(i * self.per, (i + 1) * self.per)
        return {"input_ids": self.rows.ids[s], "attention_mask": self.rows.mask[s], "labels": self.rows.labels[s]}


class PreBatchedGPT(GPT):
    def train_dataloader(self):
        return DataLoader(PreBatched(self.batch_size), batch_size=None)


class WeightedGPT(GPT):
    def train_dataloader(self):
        data = TokenDataset(64)
        weights = (data.labels.float() + 1.0) ** 2  # label 2 drawn 9 times as often as label 0
        sampler = WeightedRandomSampler(weights, num_samples=64, generator=torch.Generator().manual_seed(3))
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)


class Augmented(Dataset):
    """Tokens randomly masked (to 0) in ``__getitem__``, with torch's global generator: what a worker
    draws depends on its seed (``seed_everything(workers=True)``)."""

    def __init__(self) -> None:
        self.rows = TokenDataset(64)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        item = self.rows[i]
        keep = torch.rand(SEQ) > 0.2
        return {**item, "input_ids": item["input_ids"] * keep}


class AugmentedGPT(GPT):
    def train_dataloader(self):
        return DataLoader(Augmented(), batch_size=self.batch_size, num_workers=2)


def _loader(kind, seed_workers=False):
    def run(args, workdir):
        if seed_workers:
            L.seed_everything(7, workers=True, verbose=False)
        losses = StepLosses()
        t = trainer(args, [losses], max_steps=4, limit_val_batches=0)
        t.fit(kind(batch_size=8 // args.dp))
        return {"losses": losses.losses}

    return run


HABITS["pre-batched-loader"] = _loader(PreBatchedGPT)
HABITS["weighted-sampler"] = _loader(WeightedGPT)
HABITS["worker-augmentation"] = _loader(AugmentedGPT, seed_workers=True)


# ---------------------------------------------------------------- 7. self.log from the hooks around the optimizer
class LogsInHooks(GPT):
    """``self.log`` outside ``training_step``: a python float in ``on_before_optimizer_step`` (the lr),
    the step's loss in ``on_train_batch_end`` with ``reduce_fx="max"`` on step and epoch, and in
    ``on_after_backward`` a tensor synced over ``sync_dist_group=torch.distributed.group.WORLD``."""

    def on_after_backward(self):
        self.log("after_backward", torch.tensor(float(self.global_step)), sync_dist=True,
                 sync_dist_group=torch.distributed.group.WORLD)

    def on_before_optimizer_step(self, optimizer):
        self.log("lr_float", float(optimizer.param_groups[0]["lr"]) + self.global_step)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("batch_end_loss", outputs["loss"], on_step=True, on_epoch=True, reduce_fx="max")


def logs_in_hooks(args, workdir):
    from lightning.pytorch.loggers import CSVLogger

    losses = StepLosses()
    t = trainer(args, [losses], max_epochs=2, limit_train_batches=3, limit_val_batches=0,
                logger=CSVLogger(str(workdir), name="csv", version=0), log_every_n_steps=1)
    t.fit(LogsInHooks(batch_size=8 // args.dp))
    rows = _csv_rows(t.logger.experiment.metrics_file_path) if t.global_rank == 0 else []
    return {"losses": losses.losses, "rows": rows}


HABITS["logs-in-hooks"] = logs_in_hooks


# ---------------------------------------------------------------- 8. a penalty over self.parameters() added to the loss
class L2Penalty(GPT):
    """Weight decay by hand: ``loss + λ·Σ‖p‖²`` over ``self.parameters()`` in the step, logged as ``train_loss``."""

    def compute_loss(self, batch):
        penalty = sum(p.pow(2).sum() for p in self.parameters())
        return super().compute_loss(batch) + 0.05 * penalty


class PenaltyFreeValidation(L2Penalty):
    """Validated by the cross-entropy alone: whether the weights trained are one device's."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", GPT.compute_loss(self, batch), sync_dist=True)


def l2_penalty(args, workdir):
    losses, module = StepLosses(), PenaltyFreeValidation(batch_size=8 // args.dp, optimizer="sgd")
    t = trainer(args, [losses], max_epochs=1, limit_train_batches=4, limit_val_batches=2)
    _, raised = _raised(lambda: t.fit(module))
    return {"losses": losses.losses, "raised": raised,
            "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}


HABITS["l2-penalty"] = l2_penalty


# ---------------------------------------------------------------- 9. weights re-initialized in on_fit_start
class InitOnFitStart(GPT):
    """GPT-2's init written in ``on_fit_start`` (after the strategy set the module up): every Linear's
    weight drawn from N(0, 0.02²), its bias zeroed."""

    def on_fit_start(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)


def init_on_fit_start(args, workdir):
    losses = StepLosses()
    t = trainer(args, [losses], max_steps=3, limit_val_batches=0)
    _, raised = _raised(lambda: t.fit(InitOnFitStart(batch_size=8 // args.dp)))
    return {"losses": losses.losses, "raised": raised}


HABITS["init-on-fit-start"] = init_on_fit_start


def init_after_lr_finder(args, workdir):
    """``LearningRateFinder`` as a callback (its ``lr_find`` trains, then restores the weights, in the
    callback's ``on_fit_start``) before the module's own ``on_fit_start`` draws the weights again."""
    from lightning.pytorch.callbacks import LearningRateFinder

    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=4, early_stop_threshold=None)
    losses = StepLosses()
    t = trainer(args, [finder, losses], max_steps=2, limit_val_batches=0, default_root_dir=str(workdir))
    _, raised = _raised(lambda: t.fit(InitOnFitStart(batch_size=8 // args.dp)))
    found = getattr(finder, "optimal_lr", None)
    return {"losses": losses.losses, "raised": raised, "finder_losses": found.results["loss"] if found else []}


HABITS["init-after-lr-finder"] = init_after_lr_finder
