"""Round-9 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Habits of ordinary modules not tried in rounds 1-8: ``torch.nn.utils.prune`` in ``__init__``, forward and
backward hooks on modules whose recorded statistics are logged, gradient hooks on parameters
(``p.register_hook``), random masking drawn inside ``training_step``, a sentence-transformers-style
contrastive loss over in-batch negatives with a learnable temperature (two encoder calls, or one on the
joined views), ``validate(ckpt_path="last")``/``test(ckpt_path="best")`` after fit, and validation every
few steps across epochs (``val_check_interval`` steps, ``check_val_every_n_epoch=None``,
``limit_val_batches=0.5``). Each on fresh Trainers (``tests/helpers/round3_habits.trainer``);
tests/scripts/habits_round9.py runs several in one launch.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from tests.helpers.models import GPT, VOCAB, Block
from tests.helpers.round3_habits import StepLosses, trainer
from tests.helpers.round7_habits import _raised

REPLICATED_MLP = {**GPT.TP_PLAN, "blocks.*.fc": "replicate", "blocks.*.out": "replicate"}


class StepMetrics(L.Callback):
    """After each training batch, the logged values whose names start with ``prefix`` (rank 0's view)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.rows = prefix, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)})


def _fit(args, module, callbacks=(), plan=GPT.TP_PLAN, **kw) -> tuple:
    """Fit ``module``; ``(step losses, raised, trainer)``."""
    losses = StepLosses()
    t = trainer(args, [losses, *callbacks], plan=plan, **{"max_steps": 4, "limit_val_batches": 0, **kw})
    _, raised = _raised(lambda: t.fit(module))
    return losses.losses, raised, t


# ---------------------------------------------------------------- 1. torch.nn.utils.prune in __init__
class PrunedInInit(GPT):
    """``prune.l1_unstructured(block.fc, "weight", amount=0.3)`` on every block as the model is built:
    ``fc.weight_orig`` is the parameter, ``fc.weight_mask`` a buffer, a forward pre-hook multiplies them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for block in self.blocks:
            torch.nn.utils.prune.l1_unstructured(block.fc, "weight", amount=0.3)


def _pruned(plan):
    def run(args, workdir):
        module = PrunedInInit(batch_size=8 // args.dp, optimizer="sgd")
        losses, raised, t = _fit(args, module, plan=plan, max_epochs=1, max_steps=-1,
                                  limit_train_batches=4, limit_val_batches=2)
        return {"losses": losses, "raised": raised,
                "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}

    return run


HABITS = {"prune-in-init": _pruned(GPT.TP_PLAN), "prune-in-init-replicated": _pruned(REPLICATED_MLP)}


# ---------------------------------------------------------------- 2. hooks that record statistics which are logged
class ForwardHookStats(GPT):
    """A forward hook on ``blocks.0.<inner>`` (``fc``: column-sharded at tp2; ``ln2``: kept whole) and one
    on ``blocks.1`` (a whole block) keep their output's norm; ``training_step`` logs both."""

    def __init__(self, inner: str, **kw):
        super().__init__(**kw)
        self.seen: dict = {}
        getattr(self.blocks[0], inner).register_forward_hook(lambda m, i, o: self.seen.__setitem__("in", o.detach().norm()))
        self.blocks[1].register_forward_hook(lambda m, i, o: self.seen.__setitem__("block", o.detach().norm()))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        self.log("act_in", self.seen["in"])
        self.log("act_block", self.seen["block"])
        return loss


class BackwardHookStats(GPT):
    """``register_full_backward_hook`` on ``blocks.0`` and on ``blocks.0.<inner>``: the norms of the
    gradients of their outputs, logged in ``on_before_optimizer_step``."""

    def __init__(self, inner: str, **kw):
        super().__init__(**kw)
        self.seen: dict = {}
        self.blocks[0].register_full_backward_hook(lambda m, gi, go: self.seen.__setitem__("block", go[0].norm()))
        getattr(self.blocks[0], inner).register_full_backward_hook(
            lambda m, gi, go: self.seen.__setitem__("in", go[0].norm()))

    def on_before_optimizer_step(self, optimizer):
        self.log("grad_block", self.seen["block"])
        self.log("grad_in", self.seen["in"])


def _hook_stats(kind, inner, prefix):
    def run(args, workdir):
        metrics = StepMetrics(prefix)
        losses, raised, _ = _fit(args, kind(inner, batch_size=8 // args.dp), [metrics], max_steps=3)
        return {"losses": losses, "raised": raised, "rows": metrics.rows}

    return run


HABITS["forward-hook-sharded"] = _hook_stats(ForwardHookStats, "fc", "act_")
HABITS["forward-hook-whole"] = _hook_stats(ForwardHookStats, "ln2", "act_")
HABITS["backward-hook-sharded"] = _hook_stats(BackwardHookStats, "fc", "grad_")
HABITS["backward-hook-whole"] = _hook_stats(BackwardHookStats, "ln2", "grad_")


# ---------------------------------------------------------------- 3. gradient hooks on parameters
class GradHooks(GPT):
    """``p.register_hook`` in ``__init__``: a LayerNorm's gradient zeroed (kept as initialized) and, with
    ``sharded``, the embedding's gradient shrunk (GLM's trick) and an MLP weight's halved."""

    def __init__(self, sharded: bool, **kw):
        super().__init__(**kw)
        self.blocks[1].ln1.weight.register_hook(lambda g: torch.zeros_like(g))
        if sharded:
            self.wte.weight.register_hook(lambda g: g * 0.1)
            self.blocks[0].fc.weight.register_hook(lambda g: g * 0.5)


def _grad_hooks(sharded):
    def run(args, workdir):
        module = GradHooks(sharded, batch_size=8 // args.dp, optimizer="sgd")
        losses, raised, t = _fit(args, module, max_epochs=1, max_steps=-1, limit_train_batches=4,
                                 limit_val_batches=2)
        return {"losses": losses, "raised": raised,
                "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}

    return run


HABITS["grad-hooks-sharded"] = _grad_hooks(True)
HABITS["grad-hooks-whole"] = _grad_hooks(False)


# ---------------------------------------------------------------- 4. randomness drawn inside training_step
class MaskedInStep(GPT):
    """Tokens dropped to 0 with ``torch.rand(...) < 0.3`` in ``training_step`` (masking done in the step
    rather than the collate function), and the loss over the rows' clean continuation."""

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        noisy = torch.where(torch.rand(ids.shape, device=ids.device) < 0.3, torch.zeros_like(ids), ids)
        logits = self(noisy[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss


def masked_in_step(args, workdir):
    losses, raised, _ = _fit(args, MaskedInStep(batch_size=8 // args.dp), max_steps=4)
    return {"losses": losses, "raised": raised}


HABITS["mask-in-step"] = masked_in_step


# ---------------------------------------------------------------- 5. sentence-transformers-style contrastive training
class InBatchNegatives(GPT):
    """Mean-pooled (under the attention mask) final hidden states of two views of each row, the second
    with every fourth token dropped; cross-entropy over the scaled cosine-similarity matrix (the other
    rows are the negatives, ``MultipleNegativesRankingLoss``), scaled by 20 (its default) or, with
    ``learnable``, by a learnable temperature (CLIP's ``logit_scale``). With ``own_loop`` the step encodes
    each view with its own loop over the blocks (``encode``, two calls); otherwise both views go through
    ``forward`` joined in one call."""

    def __init__(self, own_loop: bool, learnable: bool, **kw):
        super().__init__(**kw)
        self.own_loop = own_loop
        self.logit_scale = nn.Parameter(torch.tensor(3.0)) if learnable else torch.tensor(20.0).log()

    def encode(self, ids, mask):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        h, keep = self.ln_f(x), mask.unsqueeze(-1).float()
        return F.normalize((h * keep).sum(1) / keep.sum(1), dim=-1)

    def forward(self, ids, mask):
        return self.encode(ids, mask)

    def compute_loss(self, batch):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        view = ids.clone()
        view[:, ::4] = 0
        if self.own_loop:
            a, p = self.encode(ids, mask), self.encode(view, mask)
        else:
            a, p = self(torch.cat([ids, view]), torch.cat([mask, mask])).chunk(2)
        scores = self.logit_scale.exp() * a @ p.T
        return F.cross_entropy(scores, torch.arange(len(a), device=a.device))


def _contrastive(own_loop, learnable):
    def run(args, workdir):
        losses, raised, _ = _fit(args, InBatchNegatives(own_loop, learnable, batch_size=8 // args.dp), max_steps=4)
        return {"losses": losses, "raised": raised}

    return run


HABITS["contrastive-own-loop"] = _contrastive(True, False)
HABITS["contrastive-forward"] = _contrastive(False, False)
HABITS["contrastive-learnable-scale"] = _contrastive(False, True)


# ---------------------------------------------------------------- 6. evaluation from the checkpoints after fit
def evaluate_best_and_last(args, workdir):
    """``ModelCheckpoint(monitor="val_loss", save_last=True)`` over 3 epochs, then on the same Trainer
    ``validate(ckpt_path="last")`` and ``test(ckpt_path="best")``."""
    losses = StepLosses()
    ckpt = ModelCheckpoint(dirpath=str(workdir / "ckpt"), monitor="val_loss", save_last=True)
    t = trainer(args, [losses, ckpt], max_epochs=3, limit_train_batches=2, limit_val_batches=2,
                limit_test_batches=2, enable_checkpointing=True)
    module = GPT(batch_size=8 // args.dp, lr=3e-2)
    t.fit(module)
    last = t.validate(module, ckpt_path="last", verbose=False)[0]["val_loss"]
    best = t.test(module, ckpt_path="best", verbose=False)[0]["test_loss"]
    return {"losses": losses.losses, "last_val": float(last), "best_test": float(best),
            "best": ckpt.best_model_path.rsplit("/", 1)[-1]}


HABITS["ckpt-best-last"] = evaluate_best_and_last


# ---------------------------------------------------------------- 7. validation every few steps across epochs
class ValLosses(L.Callback):
    def __init__(self) -> None:
        self.at: list = []

    def on_validation_end(self, trainer, pl_module):
        self.at.append([trainer.global_step, float(trainer.callback_metrics["val_loss"])])


def val_every_steps(args, workdir):
    """``val_check_interval=3`` with ``check_val_every_n_epoch=None`` over 2 epochs of 5 batches (the
    count runs across the epoch's end), each validation over ``limit_val_batches=0.5`` of the loader."""
    val = ValLosses()
    losses, raised, _ = _fit(args, GPT(batch_size=8 // args.dp), [val], max_steps=-1, max_epochs=2,
                             limit_train_batches=5, val_check_interval=3, check_val_every_n_epoch=None,
                             limit_val_batches=0.5)
    return {"losses": losses, "raised": raised, "val": val.at}


HABITS["val-every-steps"] = val_every_steps


# ---------------------------------------------------------------- 8. nn.Embedding options that act on rows
class EmbeddingOptions(GPT):
    """The token embedding built with ``max_norm=1.0`` (rows looked up are renormalized in place) or
    ``scale_grad_by_freq=True`` (each row's gradient divided by its count in the batch), tied to the head
    unless ``untied``."""

    def __init__(self, option: str, untied: bool = False, **kw):
        super().__init__(**kw)
        self.wte = nn.Embedding(VOCAB, 32, **{option: 1.0 if option == "max_norm" else True})
        self.lm_head = nn.Linear(32, VOCAB, bias=False)
        if not untied:
            self.lm_head.weight = self.wte.weight


def _one_microbatch(args) -> dict:
    """Trainer keywords for ``MegatronStrategy(num_microbatches=1)`` (the route a refusal names)."""
    from megastrategy import MegatronStrategy

    return {"strategy": MegatronStrategy(tp=args.tp, pp=args.pp, num_microbatches=1)} if args.strategy != "ddp" else {}


def _embedding(option, untied=False, whole_batch=False):
    def run(args, workdir):
        module = EmbeddingOptions(option, untied, batch_size=8 // args.dp, optimizer="sgd")
        losses, raised, t = _fit(args, module, max_epochs=1, max_steps=-1, limit_train_batches=4, limit_val_batches=2,
                                 **(_one_microbatch(args) if whole_batch else {}))
        return {"losses": losses, "raised": raised,
                "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}

    return run


HABITS["embedding-max-norm"] = _embedding("max_norm")
HABITS["embedding-grad-by-freq"] = _embedding("scale_grad_by_freq")
HABITS["embedding-max-norm-untied"] = _embedding("max_norm", untied=True)
HABITS["embedding-grad-by-freq-one-microbatch"] = _embedding("scale_grad_by_freq", whole_batch=True)


# ---------------------------------------------------------------- 9. a running statistic kept in a buffer by the forward
class RunningCenter(nn.Module):
    """Subtracts a running mean of its input, updated in training like BatchNorm's (a user's normalizer)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean((0, 1)), 0.5)
        return x - self.mean


class CenteredGPT(GPT):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.center = RunningCenter(32)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(self.center(x)))


def _running_buffer(whole_batch):
    def run(args, workdir):
        module = CenteredGPT(batch_size=8 // args.dp)
        losses, raised, t = _fit(args, module, max_epochs=1, max_steps=-1, limit_train_batches=4, limit_val_batches=2,
                                 **(_one_microbatch(args) if whole_batch else {}))
        return {"losses": losses, "raised": raised,
                "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}

    return run


HABITS["running-buffer"] = _running_buffer(False)
HABITS["running-buffer-one-microbatch"] = _running_buffer(True)


# ---------------------------------------------------------------- 10. a learnable scalar of the module itself used in forward
class ScalarGPT(GPT):
    """``self.scale``, a parameter of the LightningModule itself (no submodule), multiplies the logits in
    ``forward`` (a learnable temperature) and, with ``both_ends``, the token embeddings too."""

    def __init__(self, both_ends: bool, **kw):
        super().__init__(**kw)
        self.both_ends = both_ends
        self.scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, ids):
        x = self.wte(ids) * (self.scale if self.both_ends else 1.0)
        x = x + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x)) * self.scale


def _scalar(both_ends):
    def run(args, workdir):
        module = ScalarGPT(both_ends, batch_size=8 // args.dp, lr=3e-2)
        losses, raised, t = _fit(args, module, max_epochs=1, max_steps=-1, limit_train_batches=4, limit_val_batches=2)
        return {"losses": losses, "raised": raised, "scale": float(module.scale.detach()),
                "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}

    return run


HABITS["scalar-at-head"] = _scalar(False)
HABITS["scalar-both-ends"] = _scalar(True)


# ---------------------------------------------------------------- 11. a learnable scalar gate inside a block, on a sharded activation
class GatedBlock(Block):
    """The MLP's hidden activation (column-sharded at tp2) scaled by a learnable scalar of the block."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__(d, n_head)
        self.gate = nn.Parameter(torch.tensor(0.8))

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))) * self.gate)


class GatedGPT(GPT):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.blocks = nn.ModuleList(GatedBlock(32, 4) for _ in range(2))


def gated_blocks(args, workdir):
    module = GatedGPT(batch_size=8 // args.dp, lr=3e-2)
    losses, raised, t = _fit(args, module, max_epochs=1, max_steps=-1, limit_train_batches=4, limit_val_batches=2)
    return {"losses": losses, "raised": raised, "gates": [float(b.gate.detach()) for b in module.blocks],
            "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}


HABITS["gated-blocks"] = gated_blocks
