"""Round-7 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Life after ``fit``: the same Trainer's ``validate``/``test``/``predict`` and a new one's, a second
``fit`` of the same module instance with a new Trainer and a new strategy (two-phase fine-tuning, also
on another layout, and through a consolidated checkpoint), and what a script does with the module
afterwards on rank 0 (its forward, ``state_dict``, ``save_pretrained``, ``copy.deepcopy``,
``torch.save(model)``, a plain one-device Trainer). Then a few more habits: the finetuning callbacks
(also on an HF classifier), ``ReduceLROnPlateau`` with ``LearningRateMonitor`` and clipping by value,
two validation loaders with ``val_check_interval=0.5``, and ``resize_token_embeddings`` to a size tp
does not divide.
Each on fresh Trainers (``tests/helpers/round3_habits.trainer``); tests/scripts/habits_round7.py runs
several in one launch.
"""
from __future__ import annotations

import copy

import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, LearningRateMonitor
from torch.utils.data import DataLoader

from tests.helpers.models import GPT, VOCAB, TokenDataset
from tests.helpers.round3_habits import StepLosses, trainer


def _raised(call):
    """``(value, None)`` or ``(None, "Type: message")``: a refusal is a result the test reads."""
    try:
        return call(), None
    except Exception as error:  # noqa: BLE001
        return None, f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------- 1. the same Trainer after fit
def evaluate_after_fit(args, workdir):
    """``fit`` then ``validate``, ``test`` and ``predict`` on the same Trainer and module."""
    losses, module = StepLosses(), GPT(batch_size=8 // args.dp)
    t = trainer(args, [losses], max_steps=3, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    t.fit(module)
    validated = t.validate(module, verbose=False)
    tested = t.test(module, verbose=False)
    predicted = t.predict(module)
    return {"losses": losses.losses, "validated": validated, "tested": tested,
            "predicted": [float(p.sum()) for p in predicted] if t.global_rank == 0 else None}


HABITS = {"evaluate-after-fit": evaluate_after_fit}


class FrozenBackbone(GPT):
    """Two-phase fine-tuning: phase 1 trains the embeddings, final norm and head with the blocks frozen,
    phase 2 everything; the optimizer is built over the trainable parameters, as the recipes write it."""

    def freeze_blocks(self, frozen: bool) -> None:
        for p in self.blocks.parameters():
            p.requires_grad_(not frozen)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _second_fit(swap: bool):
    """Phase 1 on one Trainer, phase 2 on a new Trainer and a new strategy (``swap``: tp and pp
    exchanged), both on the same module instance."""

    def run(args, workdir):
        module = FrozenBackbone(batch_size=8 // args.dp)
        module.freeze_blocks(True)
        first = StepLosses()
        trainer(args, [first], max_steps=2, limit_val_batches=0).fit(module)
        module.freeze_blocks(False)
        second = StepLosses()
        later = copy.copy(args)
        if swap:
            later.tp, later.pp = args.pp, args.tp
        _, raised = _raised(lambda: trainer(later, [second], max_steps=2, limit_val_batches=0).fit(module))
        return {"losses": first.losses + second.losses, "first": first.losses, "raised": raised}

    return run


HABITS["second-fit"] = _second_fit(False)
HABITS["second-fit-other-layout"] = _second_fit(True)


def second_fit_via_checkpoint(args, workdir):
    """What the other-layout refusal names: ``trainer.save_checkpoint`` after phase 1, a fresh module
    loaded with ``consolidate`` (DDP: the ``.ckpt``'s ``state_dict``), phase 2 on tp and pp exchanged."""
    module = FrozenBackbone(batch_size=8 // args.dp)
    module.freeze_blocks(True)
    first, second = StepLosses(), StepLosses()
    t = trainer(args, [first], max_steps=2, limit_val_batches=0)
    t.fit(module)
    path = str(workdir / "phase1")
    t.save_checkpoint(path)
    if args.strategy == "ddp":
        state = torch.load(path, weights_only=False)["state_dict"]
    else:
        from megastrategy.checkpoint import consolidate

        state = consolidate(path)
    fresh = FrozenBackbone(batch_size=8 // args.dp)
    fresh.load_state_dict(state)
    later = copy.copy(args)
    later.tp, later.pp = args.pp, args.tp
    trainer(later, [second], max_steps=2, limit_val_batches=0).fit(fresh)
    return {"losses": first.losses + second.losses}


HABITS["second-fit-via-checkpoint"] = second_fit_via_checkpoint


def second_fit_resumed(args, workdir):
    """``trainer.save_checkpoint`` after 2 steps, then a new Trainer's ``fit(model, ckpt_path=...)`` of
    the same instance to step 4 (a script that trains on after checking something)."""
    first, second = StepLosses(), StepLosses()
    module = GPT(batch_size=8 // args.dp)
    t = trainer(args, [first], max_steps=2, limit_val_batches=0)
    t.fit(module)
    path = str(workdir / ("phase1.ckpt" if args.strategy == "ddp" else "phase1"))
    t.save_checkpoint(path)
    trainer(args, [second], max_steps=4, limit_val_batches=0).fit(module, ckpt_path=path)
    whole = StepLosses()
    L.seed_everything(7, verbose=False)
    trainer(args, [whole], max_steps=4, limit_val_batches=0).fit(GPT(batch_size=8 // args.dp))
    return {"losses": first.losses + second.losses, "uninterrupted": whole.losses}


HABITS["second-fit-resumed"] = second_fit_resumed


# ---------------------------------------------------------------- 2. the module outside the Trainer
def _fitted(args):
    losses, module = StepLosses(), GPT(batch_size=8 // args.dp)
    t = trainer(args, [losses], max_steps=2, limit_val_batches=0)
    t.fit(module)
    return t, module, losses.losses


def forward_on_rank_zero(args, workdir):
    """``model.eval(); model(batch)`` on rank 0 only, after fit, as a script checks one prediction."""
    t, module, losses = _fitted(args)
    ids = TokenDataset(2, seed=5).ids
    out, raised = None, None
    if t.global_rank == 0:
        module.eval()
        out, raised = _raised(lambda: float(module(ids).sum()))
    return {"losses": losses, "out": out, "raised": raised}


def state_dict_on_rank_zero(args, workdir):
    """``model.state_dict()`` (for ``torch.save``) on rank 0 after fit; under megastrategy also what its
    refusal names: ``trainer.save_checkpoint`` on every rank, then ``consolidate`` on rank 0."""
    t, module, losses = _fitted(args)
    report = {"losses": losses}
    if t.global_rank == 0:
        sd, report["raised"] = _raised(module.state_dict)
        if sd is not None:
            torch.save(sd, workdir.parent / f"{workdir.name}.pt")
            report["sums"] = _sums(sd)
    if args.strategy != "ddp":
        t.save_checkpoint(str(workdir / "ckpt"))
        if t.global_rank == 0:
            from megastrategy.checkpoint import consolidate

            report["consolidated"] = _sums(consolidate(str(workdir / "ckpt")))
    return report


def _sums(state: dict) -> dict:
    return {k: [list(v.shape), float(v.float().sum())] for k, v in state.items()}


def deepcopy_on_rank_zero(args, workdir):
    """``copy.deepcopy(model)`` on rank 0 after fit (a frozen teacher made from it), then its forward."""
    t, module, losses = _fitted(args)
    report = {"losses": losses}
    if t.global_rank == 0:
        clone, report["raised"] = _raised(lambda: copy.deepcopy(module))
        if clone is not None:
            clone.eval()
            report["out"], report["forward_raised"] = _raised(lambda: float(clone(TokenDataset(2, seed=5).ids).sum()))
    return report


def save_pretrained_on_rank_zero(args, workdir):
    """``model.model.save_pretrained(dir)`` on rank 0 after fit (a Hugging Face BERT classifier)."""
    from tests.helpers.models import BertClassifier

    losses, module = StepLosses(), BertClassifier(batch_size=8 // args.dp)
    t = trainer(args, [losses], plan=None, max_steps=2, limit_val_batches=0)
    t.fit(module)
    report = {"losses": losses.losses}
    if t.global_rank == 0:
        _, report["raised"] = _raised(lambda: module.model.save_pretrained(str(workdir / "hf")))
    return report


HABITS["forward-rank-zero"] = forward_on_rank_zero
HABITS["state-dict-rank-zero"] = state_dict_on_rank_zero
HABITS["deepcopy-rank-zero"] = deepcopy_on_rank_zero
HABITS["save-pretrained-rank-zero"] = save_pretrained_on_rank_zero


# ---------------------------------------------------------------- 3. callbacks that unfreeze layers mid-fit


class TrainableOnly(GPT):
    """The optimizer over the trainable parameters: what the finetuning callbacks' docs build."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class BackboneGPT(TrainableOnly):
    """``BackboneFinetuning`` reads ``pl_module.backbone``: here the blocks."""

    @property
    def backbone(self):
        return self.blocks


class UnfreezeBlocks(BaseFinetuning):
    """The docs' ``BaseFinetuning`` subclass: the blocks frozen before training, unfrozen at epoch 1
    into a new param group with its own lr."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.blocks)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(modules=pl_module.blocks, optimizer=optimizer, lr=3e-3)


class GroupLrs(L.Callback):
    """Each optimizer step's param-group learning rates (how many groups, and their lr)."""

    def __init__(self) -> None:
        self.lrs: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lrs.append([float(g["lr"]) for g in trainer.optimizers[0].param_groups])


def _finetuning(kind, callback):
    def run(args, workdir):
        losses, groups, module = StepLosses(), GroupLrs(), kind(batch_size=8 // args.dp)
        t = trainer(args, [callback(), losses, groups], max_epochs=3, limit_train_batches=2, limit_val_batches=0)
        t.fit(module)
        return {"losses": losses.losses, "lrs": groups.lrs}

    return run


HABITS["base-finetuning"] = _finetuning(TrainableOnly, UnfreezeBlocks)
HABITS["backbone-finetuning"] = _finetuning(BackboneGPT, lambda: BackboneFinetuning(unfreeze_backbone_at_epoch=1,
                                                                                   backbone_initial_lr=1e-3))


# ---------------------------------------------------------------- 4. ReduceLROnPlateau, LearningRateMonitor, clip by value
class Plateau(GPT):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=1e9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}


def plateau(args, workdir):
    """``ReduceLROnPlateau(monitor="val_loss")`` stepped each epoch (a huge threshold: it halves every
    epoch), ``LearningRateMonitor`` into a ``CSVLogger``, ``gradient_clip_algorithm="value"``."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    losses = StepLosses()
    t = trainer(args, [losses, LearningRateMonitor(logging_interval="step")], max_epochs=3, limit_train_batches=2,
                limit_val_batches=2, gradient_clip_val=0.02, gradient_clip_algorithm="value",
                logger=CSVLogger(str(workdir), name="csv", version=0), log_every_n_steps=1)
    t.fit(Plateau(batch_size=8 // args.dp))
    rows = list(csv.DictReader(open(t.logger.experiment.metrics_file_path))) if t.global_rank == 0 else []
    return {"losses": losses.losses, "rows": [{k: v for k, v in r.items() if v} for r in rows]}


HABITS["plateau-monitor-clip-value"] = plateau


# ---------------------------------------------------------------- 5. two validation loaders, validation twice an epoch
class TwoValLoaders(GPT):
    def val_dataloader(self):
        return [DataLoader(TokenDataset(8, seed=99), batch_size=self.batch_size),
                DataLoader(TokenDataset(8, seed=98), batch_size=self.batch_size)]

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, sync_dist=True)  # "val_loss/dataloader_idx_{i}"
        self.log(f"val_loss_{'ab'[dataloader_idx]}", loss, add_dataloader_idx=False)


class Validations(L.Callback):
    """The logged metrics after each validation run."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_validation_end(self, trainer, pl_module):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})


def two_val_loaders(args, workdir):
    losses, seen = StepLosses(), Validations()
    t = trainer(args, [losses, seen], max_epochs=1, limit_train_batches=4, val_check_interval=0.5, limit_val_batches=2)
    t.fit(TwoValLoaders(batch_size=8 // args.dp))
    return {"losses": losses.losses, "validations": seen.seen}


HABITS["two-val-loaders"] = two_val_loaders


# ---------------------------------------------------------------- 6. resize_token_embeddings before fit
class ResizedLM(L.LightningModule):
    """A Hugging Face causal LM from its config, its embeddings resized (tokens added) before fit."""

    def __init__(self, family: str, new_vocab: int, batch_size: int) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

        if family == "gpt2":
            cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0)
        else:
            cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        self.model = AutoModelForCausalLM.from_config(cfg)
        self.model.resize_token_embeddings(new_vocab)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(TokenDataset(32), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _resized(family):
    def run(args, workdir):
        losses = StepLosses()
        module = ResizedLM(family, 129, 8 // args.dp)
        trainer(args, [losses], plan=None, max_steps=3, limit_val_batches=0).fit(module)
        rows = module.model.get_input_embeddings().weight.shape[0] if args.pp == 1 else None  # stage 0's under pp
        return {"losses": losses.losses, "local_rows": rows}

    return run


HABITS["resize-embeddings-gpt2"] = _resized("gpt2")
HABITS["resize-embeddings-llama"] = _resized("llama")


def plain_trainer_on_rank_zero(args, workdir):
    """``L.Trainer(devices=1).test(model)`` on rank 0 after fit: a quick check on one device."""
    t, module, losses = _fitted(args)
    report = {"losses": losses}
    if t.global_rank == 0:
        one = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_test_batches=2)
        report["tested"], report["raised"] = _raised(lambda: one.test(module, verbose=False))
    return report


HABITS["plain-trainer-rank-zero"] = plain_trainer_on_rank_zero


def ddp_trainer_after_fit(args, workdir):
    """A new ``Trainer(strategy="ddp")`` on every rank fitting the module after the first fit (switching
    to Lightning's own strategy for a second phase). ``moved_ranks``: on how many ranks the weights
    changed (training moves them; so did DDP's wrapper, broadcasting rank 0's shards over the others)."""
    import torch.distributed as dist

    t, module, losses = _fitted(args)
    before = [p.detach().clone() for p in module.parameters()]
    second = StepLosses()
    other = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_steps=1, limit_val_batches=0,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[second])
    _, raised = _raised(lambda: other.fit(module))
    trained = len(second.losses)
    moved = torch.tensor([float(any(not torch.equal(a, p.detach()) for a, p in zip(before, module.parameters())))])
    dist.all_reduce(moved)
    return {"losses": losses, "raised": raised, "trained": trained, "moved_ranks": int(moved.item())}


HABITS["ddp-trainer-after-fit"] = ddp_trainer_after_fit


def new_trainer_test(args, workdir):
    """``fit`` on one Trainer, ``test`` and ``predict`` on a new one with a new strategy of the same arguments."""
    _, module, losses = _fitted(args)
    t = trainer(args, [], limit_test_batches=2, limit_predict_batches=2)
    tested = t.test(module, verbose=False)
    predicted = t.predict(module)
    return {"losses": losses, "tested": tested,
            "predicted": [float(p.sum()) for p in predicted] if t.global_rank == 0 else None}


HABITS["new-trainer-test"] = new_trainer_test


def pickle_on_rank_zero(args, workdir):
    """``torch.save(model, path)`` (the whole module object, pickled) on rank 0 after fit."""
    t, module, losses = _fitted(args)
    report = {"losses": losses}
    if t.global_rank == 0:
        _, report["raised"] = _raised(lambda: torch.save(module, workdir.parent / f"{workdir.name}-module.pt"))
    return report


HABITS["pickle-rank-zero"] = pickle_on_rank_zero


class BackboneBert(L.LightningModule):
    """A Hugging Face classifier (``AutoModelForSequenceClassification.from_config``, loss from ``labels=``)
    with ``BackboneFinetuning``: the encoder is the backbone, the optimizer over the trainable parameters."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification, BertConfig

        cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.model = AutoModelForSequenceClassification.from_config(cfg)
        self.batch_size = batch_size

    @property
    def backbone(self):
        return self.model.bert

    def train_dataloader(self):
        return DataLoader(TokenDataset(32), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def backbone_bert(args, workdir):
    losses, groups, module = StepLosses(), GroupLrs(), BackboneBert(8 // args.dp)
    t = trainer(args, [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=1e-3), losses, groups],
                plan=None, max_epochs=2, limit_train_batches=2, limit_val_batches=0)
    _, raised = _raised(lambda: t.fit(module))
    return {"losses": losses.losses, "lrs": groups.lrs, "raised": raised}


HABITS["backbone-finetuning-bert"] = backbone_bert
