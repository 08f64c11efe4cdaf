"""Tiny LightningModules that users could have written, with deterministic synthetic data.

Nothing here knows about megastrategy: the same module runs under DDPStrategy and under
MegatronStrategy, which is the point of the equivalence tests.
"""
from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 101  # divisible by neither 2 nor 4: exercises vocabulary padding
SEQ = 16


class TokenDataset(Dataset):
    """Random token sequences with a label; the same on every process for a given seed."""

    def __init__(self, n: int, seq: int = SEQ, vocab: int = VOCAB, num_labels: int = 3, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, num_labels, (n,), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
        self.mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class BaseModule(L.LightningModule):
    def __init__(self, lr: float = 1e-3, batch_size: int = 4, n_train: int = 64, n_val: int = 16, optimizer: str = "adamw"):
        super().__init__()
        self.lr, self.batch_size, self.n_train, self.n_val = lr, batch_size, n_train, n_val
        self.optimizer = optimizer

    def configure_optimizers(self):
        if self.optimizer == "sgd":  # sensitive to the gradient's scale, unlike Adam: shows clipping
            return torch.optim.SGD(self.parameters(), lr=0.5)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self):
        return DataLoader(TokenDataset(self.n_train), batch_size=self.batch_size, shuffle=getattr(self, "shuffle_train", False))

    def on_save_checkpoint(self, checkpoint):
        checkpoint["user_extra"] = "kept"  # user hooks still run under the strategy

    def val_dataloader(self):
        return DataLoader(TokenDataset(self.n_val, seed=99), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_dataloader(self):
        return DataLoader(TokenDataset(self.n_val, seed=5), batch_size=self.batch_size)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.compute_loss(batch), sync_dist=True)

    def predict_dataloader(self):
        return self.test_dataloader()

    def predict_step(self, batch, batch_idx):
        return self.compute_loss(batch).reshape(1)


class BertClassifier(BaseModule):
    """A Hugging Face BertForSequenceClassification, used as-is."""

    def __init__(self, n_layer: int = 2, **kw):
        super().__init__(**kw)
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n_layer, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.model = BertForSequenceClassification(cfg)

    def compute_loss(self, batch):
        return self.model(**batch).loss

    def predict_step(self, batch, batch_idx):
        return self.model(**batch).logits  # per-example outputs, as real prediction code returns


class BertSummedLoss(BertClassifier):
    """A user who sums the loss over the batch instead of averaging it (``reduction="sum"``): one
    device's loss is over the whole batch, each pipeline microbatch's over part of it."""

    def compute_loss(self, batch):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        return torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")


class BertManualOptimization(BertClassifier):
    """Manual optimization as Lightning documents it: ``manual_backward``, ``opt.step()``,
    ``opt.zero_grad()``, with gradient clipping through ``self.clip_gradients``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.compute_loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.log("train_loss", loss)
        return loss


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(BaseModule):
    """A hand-written GPT with a tied input/output embedding; sharded through a user tp_plan."""

    TP_PLAN = {
        "wte": "vocab",
        "lm_head": "vocab",
        "blocks.*.q": "column",
        "blocks.*.k": "column",
        "blocks.*.v": "column",
        "blocks.*.proj": "row",
        "blocks.*.fc": "column",
        "blocks.*.out": "row",
    }

    def __init__(self, d: int = 32, n_head: int = 4, n_layer: int = 2, **kw):
        super().__init__(**kw)
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))

    def compute_loss(self, batch):
        ids = batch["input_ids"]
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class EncoderClassifier(BaseModule):
    """A plain torch.nn.TransformerEncoder text classifier."""

    def __init__(self, d: int = 32, n_head: int = 4, n_layer: int = 2, **kw):
        super().__init__(**kw)
        self.emb = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, n_head, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d, 3)

    def compute_loss(self, batch):
        pad = batch["attention_mask"] == 0
        h = self.encoder(self.emb(batch["input_ids"]) * math.sqrt(self.emb.embedding_dim), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        pooled = (h * keep).sum(1) / keep.sum(1)
        return F.cross_entropy(self.head(pooled), batch["labels"])


class BertWithMetrics(BertClassifier):
    """Logs torchmetrics objects, a prog-bar value and a log_dict, as real training code does."""

    def __init__(self, **kw):
        super().__init__(**kw)
        import torchmetrics

        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.train_acc(out.logits.argmax(-1), batch["labels"])
        self.log("train_loss", out.loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log_dict({"logit_mean": out.logits.mean()})
        return out.loss

    def validation_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.val_acc(out.logits.argmax(-1), batch["labels"])
        self.log("val_loss", out.loss, sync_dist=True, prog_bar=True)
        self.log("val_acc", self.val_acc, on_epoch=True)


class LMDataset(TokenDataset):
    """Token sequences with right padding (none with ``pad=False``); labels: the tokens, -100 on padding."""

    def __init__(self, n: int, pad: bool = True, **kw):
        super().__init__(n, **kw)
        if not pad:
            self.mask = torch.ones_like(self.mask)

    def __getitem__(self, i):
        ids, mask = self.ids[i], self.mask[i]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class LlamaLM(BaseModule):
    """A Hugging Face LlamaForCausalLM (GQA) built from a config, loss through ``labels=``; its
    validation epoch all-gathers one value per example, as user code collecting predictions does."""

    def __init__(self, n_layer: int = 2, seq: int = SEQ, pad: bool = True, **kw):
        super().__init__(**kw)
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(cfg)
        self.seq, self.pad, self.seen, self.gathered = seq, pad, [], []

    def train_dataloader(self):
        return DataLoader(LMDataset(self.n_train, pad=self.pad, seq=self.seq), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(LMDataset(self.n_val, pad=self.pad, seq=self.seq, seed=99), batch_size=self.batch_size)

    def compute_loss(self, batch):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"][:, 0].float())
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        self.gathered.append(int(self.all_gather(torch.cat(self.seen)).numel()))
        self.seen.clear()


from tests.helpers import moe_models  # noqa: E402  (after BaseModule, which it subclasses)

MODELS = {"bert": BertClassifier, "bert-manual": BertManualOptimization, "gpt": GPT, "llama": LlamaLM, "encoder": EncoderClassifier, "bert-metrics": BertWithMetrics,
          "moe-gpt": lambda **kw: moe_models.MoEGPT(**kw)}
