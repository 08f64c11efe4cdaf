"""A fine-tuning LightningModule written the way users write one, for the user-habit tests.

It keeps ``self.save_hyperparameters()``, so ``HabitBert.load_from_checkpoint(path)`` rebuilds it
without arguments; frozen embeddings / first encoder layers; an optimizer over the trainable
parameters (``filter(lambda p: p.requires_grad, ...)``) or over all; a scheduler dict; and two
validation loaders logged per ``dataloader_idx``. Nothing here knows about megastrategy.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import SEQ, VOCAB, TokenDataset


class HabitBert(L.LightningModule):
    def __init__(self, freeze_embeddings: bool = False, freeze_layers: int = 0, all_params: bool = False,
                 scheduler: str = "none", param_groups: bool = False, lr: float = 1e-3, n_layer: int = 4, n_train: int = 24, batch_size: int = 4):
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModelForSequenceClassification, BertConfig

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n_layer, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.model = AutoModelForSequenceClassification.from_config(config)
        if freeze_embeddings:
            self.model.bert.embeddings.requires_grad_(False)
        for layer in self.model.bert.encoder.layer[:freeze_layers]:
            layer.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = self.model(**batch).loss
        if dataloader_idx == 0:  # the monitored value; each loader's also as val_loss_per_loader/dataloader_idx_N
            self.log("val_loss", loss, sync_dist=True, add_dataloader_idx=False)
        self.log("val_loss_per_loader", loss, sync_dist=True)

    def train_dataloader(self):
        return DataLoader(TokenDataset(self.hparams.n_train), batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return [DataLoader(TokenDataset(8, seed=99), batch_size=self.hparams.batch_size),
                DataLoader(TokenDataset(8, seed=98), batch_size=self.hparams.batch_size)]

    def _param_groups(self):
        """All or the trainable parameters; with ``param_groups``, the encoder at a tenth of the head's lr."""
        keep = (lambda p: True) if self.hparams.all_params else (lambda p: p.requires_grad)
        if not self.hparams.param_groups:
            return [p for p in self.parameters() if keep(p)]
        return [{"params": [p for p in self.model.bert.parameters() if keep(p)], "lr": self.hparams.lr / 10},
                {"params": [p for p in self.model.classifier.parameters() if keep(p)]}]

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self._param_groups(), lr=self.hparams.lr, weight_decay=0.01)
        kind = self.hparams.scheduler
        if kind == "none":
            return opt
        if kind == "plateau":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}
        total = self.trainer.estimated_stepping_batches
        if kind == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=total)
        else:
            from transformers import get_linear_schedule_with_warmup

            sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
