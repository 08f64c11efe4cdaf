"""A small GPT whose MLPs are ``MoELayer(num_experts=4, top_k=2)``, in the style of
``tests/helpers/models.py`` (registered there as ``"moe-gpt"``; that module imports this one
lazily, so either may be imported first).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megastrategy.moe import MoELayer
from tests.helpers.models import SEQ, VOCAB, BaseModule


class MoEBlock(nn.Module):
    def __init__(self, d: int, n_head: int, num_experts: int, top_k: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.mlp = MoELayer(d, 2 * d, num_experts=num_experts, top_k=top_k)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.ln2(x))


class MoEGPT(BaseModule):
    """GPT with tied embeddings and mixture-of-experts MLPs; attention sharded by a user tp_plan,
    the experts by expert parallelism."""

    TP_PLAN = {
        "wte": "vocab",
        "lm_head": "vocab",
        "blocks.*.q": "column",
        "blocks.*.k": "column",
        "blocks.*.v": "column",
        "blocks.*.proj": "row",
    }

    def __init__(self, d: int = 32, n_head: int = 4, n_layer: int = 2, num_experts: int = 4, top_k: int = 2, **kw):
        super().__init__(**kw)
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(MoEBlock(d, n_head, num_experts, top_k) for _ in range(n_layer))
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


# -----------------------------------------------------------------------------------------------
# Throwaway: MegatronStrategy + megastrategy.moe.integration, until the strategy calls it itself.
# -----------------------------------------------------------------------------------------------
