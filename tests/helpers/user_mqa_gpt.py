"""A hand-written GPT with a fused multi-query (or grouped-query) ``qkv`` projection, the way users
write one: ``nn.Linear(d, (n_head + 2 * n_kv_heads) * head_dim)`` split into ``[q | k | v]``, SDPA with
``enable_gqa``. Structural detection reads it like GPT-BigCode (megastrategy.layers.multi_query)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 16, 32, 4, 2


class FusedQKVAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_head, self.n_kv_heads, self.head_dim = n_head, n_kv_heads, n_embd // n_head
        self.qkv = nn.Linear(n_embd, (n_head + 2 * n_kv_heads) * self.head_dim)
        self.proj = nn.Linear(n_head * self.head_dim, n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(x).split([self.n_head * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd))


class Block(nn.Module):
    def __init__(self, n_kv_heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(WIDTH), FusedQKVAttention(WIDTH, HEADS, n_kv_heads)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class FusedQKVGPT(nn.Module):
    """``n_kv_heads=1``: multi-query; 2: grouped-query (2 query heads per key/value head)."""

    def __init__(self, n_kv_heads: int = 1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.h = nn.ModuleList([Block(n_kv_heads) for _ in range(LAYERS)])
        self.ln_f, self.lm_head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss
