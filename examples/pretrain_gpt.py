"""Pretrain a small GPT language model from scratch with MegatronStrategy, reporting perplexity.

An ordinary LightningModule: nothing in it knows about the strategy. The input and output
embeddings are tied, and the loss is a plain ``F.cross_entropy`` over the vocabulary, which
under tensor parallelism runs vocab-parallel without gathering the logits.

    python examples/pretrain_gpt.py --tp 2 --devices 2 --max-steps 40
    python examples/pretrain_gpt.py --tp 2 --pp 2 --vp 2 --devices 4 --max-steps 40
    python examples/pretrain_gpt.py --text-file my_corpus.txt --tp 2 --devices 4
    python examples/pretrain_gpt.py --num-experts 4 --top-k 2 --ep 2 --devices 2   # mixture of experts
"""
from __future__ import annotations

import argparse
import math
import os
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

# Third-party notices about neither this script nor megastrategy, repeated by every rank: Lightning's
# pytree helper still uses a torch API that newer torch deprecates. Filtered here, not in the library.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

BUILTIN_CORPUS = """\
Tensor parallelism splits each weight matrix of a layer across devices, so that every device
holds a slice of every layer and the devices exchange partial results twice per layer.
Pipeline parallelism gives each device a contiguous range of layers and streams microbatches
through the stages, so that while one stage runs the backward pass of an early microbatch the
next stage runs the forward pass of a later one. Data parallelism copies the model and splits
the batch, averaging gradients before every optimizer step. Expert parallelism places the
experts of a mixture-of-experts layer on different devices and sends each token to the device
that holds the experts it was routed to. Combined, these let a model that does not fit on one
device train on many, with the same numbers that one large device would produce.
"""


class CharCorpus(Dataset):
    """Character-level language modelling windows over one text."""

    def __init__(self, text: str, seq_len: int, vocab: list[str]):
        index = {c: i for i, c in enumerate(vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(1, len(self.data) - self.seq_len - 1)

    def __getitem__(self, i):
        chunk = self.data[i : i + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, num_experts: int | None = None, top_k: int = 2):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.attn_out = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        if num_experts:  # mixture of experts: the MLP becomes num_experts MLPs and a top-k router
            from megastrategy.moe import MoELayer

            self.moe = MoELayer(d_model, 4 * d_model, num_experts=num_experts, top_k=top_k)
        else:
            self.fc_in = nn.Linear(d_model, 4 * d_model)
            self.fc_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (proj(h).view(b, t, self.n_head, -1).transpose(1, 2) for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, -1))
        if hasattr(self, "moe"):
            return x + self.moe(self.ln_2(x))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class GPT(L.LightningModule):
    # How the strategy should split the layers over tensor-parallel ranks.
    TP_PLAN = {
        "token_embedding": "vocab",
        "lm_head": "vocab",
        "blocks.*.query": "column",
        "blocks.*.key": "column",
        "blocks.*.value": "column",
        "blocks.*.attn_out": "row",
        "blocks.*.fc_in": "column",
        "blocks.*.fc_out": "row",
    }

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_head: int, n_layer: int, lr: float,
                 num_experts: int | None = None, top_k: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, num_experts, top_k) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied input/output embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(ids) + self.position_embedding(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def _loss(self, batch) -> torch.Tensor:
        ids, targets = batch
        logits = self(ids)
        return F.cross_entropy(logits.view(-1, self.hparams.vocab_size), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", torch.exp(loss), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-file", type=Path, help="a local UTF-8 text file (default: a built-in paragraph)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (--n-layer must divide by pp·vp)")
    p.add_argument("--vp", type=int, default=None, help="virtual stages per rank: the interleaved schedule")
    p.add_argument("--num-microbatches", type=int, default=None, help="per batch under pp (default: pp)")
    p.add_argument("--num-experts", type=int, default=None, help="replace every MLP by a mixture of this many experts")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (with --num-experts)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: tp)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", choices=["megatron", "ddp"], default="megatron", help="ddp: Lightning's own, for comparison")
    args = p.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    L.seed_everything(args.seed, verbose=False)
    text = args.text_file.read_text(encoding="utf-8") if args.text_file else BUILTIN_CORPUS
    vocab = sorted(set(text))
    split = int(len(text) * 0.9)
    train = CharCorpus(text[:split], args.seq_len, vocab)
    val = CharCorpus(text[split:], args.seq_len, vocab)
    model = GPT(len(vocab), args.seq_len, args.d_model, args.n_head, args.n_layer, args.lr, args.num_experts, args.top_k)

    if args.strategy == "megatron":
        from megastrategy import MegatronStrategy

        plan = {k: v for k, v in GPT.TP_PLAN.items() if not (args.num_experts and k.startswith("blocks.*.fc_"))}
        strategy = MegatronStrategy(
            tp=args.tp, pp=args.pp, vp=args.vp, num_microbatches=args.num_microbatches,
            tp_plan=plan, ep=args.ep, etp=args.etp,
        )
    else:
        strategy = "ddp"
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=min(args.max_steps, 20),
        limit_val_batches=4,
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
    )
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
    )
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(
            f"done: {args.max_steps} steps, tp={args.tp} pp={args.pp} vp={args.vp}, devices={args.devices}; "
            f"train_loss={float(metrics['train_loss']):.3f} "
            f"val_loss={float(metrics['val_loss']):.3f} val_ppl={math.exp(float(metrics['val_loss'])):.2f}"
        )


if __name__ == "__main__":
    main()
