"""Round-6 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Modules written the way Lightning's docs and tutorials write them: the optimization hooks
overridden (``optimizer_step`` with the closure and a hand-made warm-up, ``optimizer_zero_grad``
keeping the tensors, ``configure_gradient_clipping``, ``lr_scheduler_step``), ``AdamW(foreach=True)``
over two groups with their own learning rates, the strategy's ``broadcast``/``reduce`` and the
Trainer's sizes, a ``MetricCollection`` with compute groups, ``BinaryAUROC`` and a text metric over a
batch's strings, the finder callbacks, ``ZeroRedundancyOptimizer``, LBFGS and Adafactor, the
``grad_norm`` logging recipe, parameter statistics through the logger, the user's own activation
checkpointing, a contrastive loss over ``all_gather(sync_grads=True)``, and a few loss, embedding and
loop options. Each on a fresh Trainer (``tests/helpers/round3_habits.trainer``);
tests/scripts/habits_round6.py runs several in one launch.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from torch.utils.data import DataLoader

from tests.helpers.models import GPT, VOCAB, TokenDataset
from tests.helpers.round3_habits import StepLosses, trainer


def _lrs(optimizer) -> list:
    return [float(g["lr"]) for g in optimizer.param_groups]


# ---------------------------------------------------------------- 1. the optimization hooks
class WarmupInOptimizerStep(GPT):
    """Lightning's documented recipe: the closure given to ``optimizer.step`` and a hand-made
    learning-rate warm-up written into the param groups after it."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen_lrs: list = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        scale = min(1.0, float(self.trainer.global_step + 2) / 4.0)
        for group in optimizer.param_groups:
            group["lr"] = scale * self.lr * 10
        self.seen_lrs.append(_lrs(optimizer))


class KeepGradTensors(GPT):
    """``optimizer_zero_grad`` overridden to zero in place (``set_to_none=False``), as older docs show."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class OwnClipping(GPT):
    """``configure_gradient_clipping`` clipping by norm from the second step on (the docs' recipe
    clips from an epoch on), with the value and algorithm the Trainer passes."""

    def __init__(self, **kw) -> None:
        super().__init__(optimizer="sgd", **kw)
        self.clip_args: list = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_args.append([gradient_clip_val, gradient_clip_algorithm])
        if self.trainer.global_step >= 1:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)


class OwnSchedulerStep(GPT):
    """``lr_scheduler_step`` overridden (timm's schedulers need it): steps by the global step."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.stepped: list = []

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step(self.trainer.global_step)
        self.stepped.append(scheduler.get_last_lr()[0])


class ForeachGroups(GPT):
    """The Hugging Face recipe: no weight decay on biases and LayerNorms, another lr there, with
    ``AdamW(foreach=True, fused=False)``."""

    def configure_optimizers(self):
        no_decay = ("bias", "ln")
        decay = [p for n, p in self.named_parameters() if not any(k in n for k in no_decay)]
        rest = [p for n, p in self.named_parameters() if any(k in n for k in no_decay)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}],
                                 lr=1e-2, foreach=True, fused=False)


def _fit(kind, report=(), **flags):
    """Fit ``kind`` for 3 steps with Trainer ``flags``; the report adds the module's ``report`` attributes."""

    def run(args, workdir):
        losses, module = StepLosses(), kind(batch_size=8 // args.dp)
        t = trainer(args, [losses], **{"max_steps": 3, "limit_val_batches": 0, **flags})
        t.fit(module)
        return {"losses": losses.losses, "lrs": _lrs(t.optimizers[0]), **{k: getattr(module, k) for k in report}}

    return run


HABITS = {
    "optimizer-step-closure": _fit(WarmupInOptimizerStep, ["seen_lrs"]),
    "zero-grad-keep": _fit(KeepGradTensors),
    "configure-clipping": _fit(OwnClipping, ["clip_args"], gradient_clip_val=0.05, gradient_clip_algorithm="norm"),
    "scheduler-step": _fit(OwnSchedulerStep, ["stepped"]),
    "foreach-groups": _fit(ForeachGroups),
}


# ---------------------------------------------------------------- 2. the strategy's collectives and sizes
class Scaled(GPT):
    """Scales the learning rate by the number of data replicas, broadcasts rank 0's run name, and
    reduces a count with ``sum``: what the docs and tutorials do with ``self.trainer``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.sizes: dict = {}

    def setup(self, stage):
        import random

        self.run_name = self.trainer.strategy.broadcast(f"run-{random.random():.6f}")

    def configure_optimizers(self):
        replicas = self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]
        return torch.optim.AdamW(self.parameters(), lr=self.lr * replicas)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        seen = self.trainer.strategy.reduce(torch.tensor(float(len(batch["input_ids"]))), reduce_op="sum")
        self.sizes.setdefault("examples_summed", []).append(float(seen))
        return loss

    def on_fit_start(self):
        t = self.trainer
        names = [None] * t.world_size
        torch.distributed.all_gather_object(names, self.run_name)
        self.sizes.update(world_size=t.world_size, num_devices=t.num_devices, num_nodes=t.num_nodes,
                          replicas=t.strategy.distributed_sampler_kwargs["num_replicas"], one_name=len(set(names)) == 1,
                          rank_zero=t.is_global_zero == (t.global_rank == 0))


HABITS["strategy-sizes"] = _fit(Scaled, ["sizes"])


# ---------------------------------------------------------------- 3. metrics in validation
class TextTokens(TokenDataset):
    """TokenDataset rows with a string field: the batch carries a list of strings."""

    def __getitem__(self, i):
        row = super().__getitem__(i)
        return {"input_ids": row["input_ids"], "text": " ".join(str(int(t) % 7) for t in row["input_ids"][1:5])}


class Metered(GPT):
    """Validation with a ``MetricCollection`` (compute groups on) and ``BinaryAUROC`` (list states),
    updated in the step and logged as objects; with ``text=True`` also ``CharErrorRate`` over the
    batch's strings (a list the collate function made)."""

    def __init__(self, text: bool = False, **kw) -> None:
        super().__init__(**kw)
        import torchmetrics
        from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassPrecision, MulticlassRecall
        from torchmetrics.text import CharErrorRate

        self.val_metrics = torchmetrics.MetricCollection(
            {"acc": MulticlassAccuracy(VOCAB, average="micro"), "prec": MulticlassPrecision(VOCAB, average="macro"),
             "rec": MulticlassRecall(VOCAB, average="macro")}, prefix="val_", compute_groups=True)
        self.val_auroc, self.val_cer = BinaryAUROC(), CharErrorRate() if text else None

    def val_dataloader(self):
        return DataLoader(TextTokens(16, seed=99), batch_size=self.batch_size)

    def validation_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self(ids[:, :-1])
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)))
        preds, target = logits.argmax(-1).reshape(-1), ids[:, 1:].reshape(-1)
        self.val_metrics.update(preds, target)
        even = logits.softmax(-1)[..., ::2].sum(-1).clamp(0, 1)  # a sum a rounding above 1 would be taken for logits
        self.val_auroc.update(even.reshape(-1), (target % 2 == 0).long())
        self.log_dict(self.val_metrics)
        self.log("val_auroc", self.val_auroc)
        if self.val_cer is not None:
            self.val_texts.append(len(batch["text"]))
            guessed = [" ".join(str(int(t) % 7) for t in row[:4]) for row in logits.argmax(-1)]
            self.val_cer.update(guessed, list(batch["text"]))
            self.log("val_cer", self.val_cer)


def _metrics(text: bool):
    def run(args, workdir):
        losses, module = StepLosses(), Metered(text=text, batch_size=8 // args.dp)
        module.val_texts = []  # how many strings each call of the step saw
        t = trainer(args, [losses], max_steps=2, val_check_interval=2, limit_val_batches=2)
        t.fit(module)
        validated = t.validate(module, verbose=False)
        return {"losses": losses.losses, "logged": {k: float(v) for k, v in t.callback_metrics.items()},
                "validated": validated, "texts": module.val_texts}

    return run


HABITS["metrics"] = _metrics(text=False)
HABITS["text-metric"] = _metrics(text=True)


# ---------------------------------------------------------------- 4. the finder callbacks
def lr_finder_callback(args, workdir):
    """``LearningRateFinder`` as a callback (it runs ``lr_find`` in ``on_fit_start``), then the fit."""
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=8, early_stop_threshold=None)
    losses, module = StepLosses(), GPT(batch_size=8 // args.dp)
    t = trainer(args, [finder, losses], max_steps=2, limit_val_batches=0, default_root_dir=str(workdir))
    t.fit(module)
    return {"losses": losses.losses, "suggestion": finder.optimal_lr.suggestion(), "lr": module.lr,
            "finder_losses": finder.optimal_lr.results["loss"]}


def batch_size_finder_callback(args, workdir):
    """``BatchSizeFinder``: Lightning refuses it with DDP; the same refusal (or DDP's result)."""
    t = trainer(args, [BatchSizeFinder(mode="power", steps_per_trial=1, init_val=2, max_trials=3)], max_steps=2,
                limit_val_batches=0, default_root_dir=str(workdir))
    module = GPT(batch_size=8 // args.dp)
    try:
        t.fit(module)
        raised = None
    except Exception as error:  # noqa: BLE001 - compared with DDP's
        raised = f"{type(error).__name__}: {error}"
    return {"raised": raised, "batch_size": module.batch_size}


HABITS["lr-finder-callback"] = lr_finder_callback
HABITS["batch-size-finder-callback"] = batch_size_finder_callback


# ---------------------------------------------------------------- 5. torch's ZeroRedundancyOptimizer
class ZeroGPT(GPT):
    """``ZeroRedundancyOptimizer`` over the default group, as torch's DDP tutorial builds it."""

    def configure_optimizers(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)


def zero_redundancy(args, workdir):
    losses = StepLosses()
    try:
        trainer(args, [losses], max_steps=3, limit_val_batches=0).fit(ZeroGPT(batch_size=8 // args.dp))
        raised = None
    except Exception as error:  # noqa: BLE001 - the test reads the message
        raised = f"{type(error).__name__}: {error}"
    return {"losses": losses.losses, "raised": raised}


HABITS["zero-redundancy"] = zero_redundancy


# ---------------------------------------------------------------- 6. the grad_norm logging recipe
class LogsGradNorms(GPT):
    """Lightning's recipe, ``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step``,
    with ``megastrategy.grad_norm`` (Lightning's own outside the strategy); also a submodule's inf-norms."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.norms: list = []

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

        from megastrategy import grad_norm

        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        blocks = grad_norm(self.blocks, "inf", group_separator=".")
        local = lightning_grad_norm(self, 2)["grad_2.0_norm_total"]
        self.norms.append({"model": {k: float(v) for k, v in norms.items()}, "blocks": {k: float(v) for k, v in blocks.items()},
                           "local_total": float(local)})


def grad_norms(args, workdir):
    losses, module = StepLosses(), LogsGradNorms(batch_size=8 // args.dp)
    t = trainer(args, [losses], max_steps=2, limit_val_batches=0)
    t.fit(module)
    return {"losses": losses.losses, "norms": module.norms, "logged": {k: float(v) for k, v in t.callback_metrics.items()}}


HABITS["grad-norm"] = grad_norms


# ---------------------------------------------------------------- 7. a step skipped in optimizer_step
class StepEveryOther(GPT):
    """The docs' ``optimizer_step`` that steps every second batch and otherwise calls the closure by
    itself ("to run training_step + backward without an optimizer step")."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if (batch_idx + 1) % 2 == 0:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


HABITS["closure-without-step"] = _fit(StepEveryOther)
HABITS["closure-without-step-accumulate"] = _fit(StepEveryOther, accumulate_grad_batches=2)
HABITS["zero-grad-keep-accumulate"] = _fit(KeepGradTensors, accumulate_grad_batches=2)
HABITS["closure-without-step-sgd"] = _fit(type("StepEveryOtherSGD", (StepEveryOther,), {
    "configure_optimizers": lambda self: torch.optim.SGD(self.parameters(), lr=0.5)}), max_steps=6)


class ParamStats(GPT):
    """Logs parameter statistics through the logger's experiment from rank 0 (as histogram code does):
    of what rank 0 holds (its shards, its stage). Reading another stage's module there raises
    (``UnreachableAttributeError``)."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0:
            stats = {f"{n}_mean": float(p.detach().float().mean()) for n, p in self.named_parameters()}
            self.logger.experiment.log_metrics(stats, self.global_step)


def param_stats(args, workdir):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    losses = StepLosses()
    t = trainer(args, [losses], max_steps=2, limit_val_batches=0, logger=CSVLogger(str(workdir)))
    try:
        t.fit(ParamStats(batch_size=8 // args.dp))
        raised = None
    except Exception as error:  # noqa: BLE001 - compared with DDP's
        raised = f"{type(error).__name__}: {error}"
    rows = list(csv.DictReader(open(t.logger.experiment.metrics_file_path))) if t.global_rank == 0 and not raised else []
    return {"losses": losses.losses, "raised": raised, "columns": sorted({k for r in rows for k, v in r.items() if v})}


HABITS["param-stats"] = param_stats


# ---------------------------------------------------------------- 8. the user's own activation checkpointing
class CheckpointedGPT(GPT):
    """``torch.utils.checkpoint.checkpoint(block, x)`` per block in the forward, as memory tutorials write it."""

    reentrant = False

    def forward(self, ids):
        from torch.utils.checkpoint import checkpoint

        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant) if self.training else b(x)
        return self.lm_head(self.ln_f(x))


HABITS["user-checkpointing"] = _fit(CheckpointedGPT)
HABITS["user-checkpointing-reentrant"] = _fit(type("ReentrantGPT", (CheckpointedGPT,), {"reentrant": True}))


# ---------------------------------------------------------------- 9. an IterableDataset sharded by worker and rank
class WorkerShards(torch.utils.data.IterableDataset):
    """Rows ``i`` with ``i % (workers * replicas) == worker + workers * rank``: the split torch's docs
    show for workers, combined with Lightning's rank (``trainer.global_rank``, ``world_size``)."""

    def __init__(self, rows, rank_and_size) -> None:
        self.rows, self.rank_and_size = rows, rank_and_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, size = self.rank_and_size
        shard, shards = worker + workers * rank, workers * size
        return (self.rows[i] for i in range(len(self.rows)) if i % shards == shard)


class WorkerShardedGPT(GPT):
    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs if self.trainer.world_size > 1 else {"rank": 0, "num_replicas": 1}
        shards = WorkerShards(TokenDataset(32), (kw["rank"], kw["num_replicas"]))
        return DataLoader(shards, batch_size=self.batch_size, num_workers=2)


HABITS["worker-shards"] = _fit(WorkerShardedGPT)


def strategy_recompute(args, workdir):
    """What the pp refusal's fix names: the strategy's ``activation_checkpointing="full"`` instead."""
    extra = {}
    if args.strategy != "ddp":
        from megastrategy import MegatronStrategy

        extra["strategy"] = MegatronStrategy(tp=args.tp, pp=args.pp, tp_plan=GPT.TP_PLAN if args.tp > 1 else None,
                                             activation_checkpointing="full")
    losses = StepLosses()
    trainer(args, [losses], max_steps=3, limit_val_batches=0, **extra).fit(GPT(batch_size=8 // args.dp))
    return {"losses": losses.losses}


HABITS["strategy-recompute"] = strategy_recompute


# ---------------------------------------------------------------- 10. a contrastive loss over the global batch
class Contrastive(GPT):
    """SimCLR/CLIP habit: embeddings gathered from every replica with ``self.all_gather(z, sync_grads=True)``,
    each row's positive at its global index."""

    def compute_loss(self, batch):
        ids = batch["input_ids"]
        z = F.normalize(self(ids).mean(1), dim=-1)
        every = self.all_gather(z, sync_grads=True)
        every = every.flatten(0, 1) if every.dim() == 3 else every
        offset = self.trainer.strategy.distributed_sampler_kwargs["rank"] * len(z) if self.trainer.world_size > 1 else 0
        if every.shape[0] == len(z):
            offset = 0
        labels = torch.arange(len(z), device=z.device) + offset
        return F.cross_entropy(z @ every.T / 0.1, labels)


HABITS["contrastive"] = _fit(Contrastive)


def contrastive_one_microbatch(args, workdir):
    """Under pp each microbatch's rows are contrasted with each other only (a loss that is not a mean
    over examples: documented); ``num_microbatches=1`` contrasts the whole batch, as one device does."""
    extra = {}
    if args.strategy != "ddp":
        from megastrategy import MegatronStrategy

        extra["strategy"] = MegatronStrategy(tp=args.tp, pp=args.pp, tp_plan=GPT.TP_PLAN if args.tp > 1 else None,
                                             num_microbatches=1)
    losses = StepLosses()
    trainer(args, [losses], max_steps=3, limit_val_batches=0, **extra).fit(Contrastive(batch_size=8 // args.dp))
    return {"losses": losses.losses}


HABITS["contrastive-one-microbatch"] = contrastive_one_microbatch


# ---------------------------------------------------------------- 11. loss and embedding options tutorials set
class SmoothedGPT(GPT):
    """``F.cross_entropy(..., label_smoothing=0.1)``, as the classification and LM recipes set it."""

    def compute_loss(self, batch):
        ids = batch["input_ids"]
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), label_smoothing=0.1)


class PaddedEmbeddingGPT(GPT):
    """``nn.Embedding(vocab, d, padding_idx=0)``: the padding row gets no gradient."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.wte = torch.nn.Embedding(VOCAB, 32, padding_idx=0)
        self.lm_head = torch.nn.Linear(32, VOCAB, bias=False)

    def on_train_end(self):
        self.pad_row = float(self.wte.weight[0].abs().sum()) if self.wte.weight.shape[0] else None


class EarlyEpochEnd(GPT):
    """``on_train_batch_start`` returning -1 ends the epoch (Lightning's documented early exit)."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 2 else None


HABITS["label-smoothing"] = _fit(SmoothedGPT)
HABITS["padding-idx"] = _fit(PaddedEmbeddingGPT)
HABITS["batch-start-minus-one"] = _fit(EarlyEpochEnd, max_steps=-1, max_epochs=2)


# ---------------------------------------------------------------- 12. an optimizer that calls the closure itself
class LbfgsGPT(GPT):
    """``torch.optim.LBFGS`` (Lightning passes it the closure; it runs forward and backward several
    times per step)."""

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3, history_size=3)


def _refused(kind):
    """Fit ``kind``; the refusal's message if the strategy refuses it (the test reads it)."""

    def run(args, workdir):
        try:
            return _fit(kind)(args, workdir)
        except Exception as error:  # noqa: BLE001
            return {"losses": [], "raised": f"{type(error).__name__}: {error}"}

    return run


HABITS["lbfgs"] = _refused(LbfgsGPT)


class AdafactorGPT(GPT):
    """``torch.optim.Adafactor`` (T5's recipe): second moments factored into row and column statistics."""

    def configure_optimizers(self):
        return torch.optim.Adafactor(self.parameters(), lr=1e-2)


HABITS["adafactor"] = _refused(AdafactorGPT)
