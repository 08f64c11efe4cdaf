"""Transformers written by hand, the way users write them, for auto-detection outside Hugging Face
(megastrategy.layers.user_stack_plans) and its fallback (megastrategy.layers.block_fallback).

* ``NanoGPT``: karpathy's nanoGPT, unchanged in what matters: ``c_attn`` packed ``[q|k|v]`` split by
  ``self.n_embd``, ``C`` read from ``x.size()``, tied ``wte``/``lm_head``, blocks in
  ``transformer.h``. Its attention cannot run on local heads (kept whole); its MLP shards.
* ``MinGPT``: karpathy's minGPT: separate ``key``/``query``/``value``, ``view(B, T, self.n_head,
  C // self.n_head)`` with ``C`` from ``x.size()`` (kept whole), an ``nn.Sequential`` MLP (sharded).
* ``HandLlama``: q/k/v/o with grouped-query heads (``self.n_heads``, ``self.n_kv_heads`` and
  ``self.head_dim`` read in the forward), rotary tables from a buffer of the model, RMSNorm, SwiGLU
  ``w1``/``w3``/``w2``: everything shards.

Every model maps ``(ids, targets=None) -> (logits, loss)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 16, 32, 4, 2


def _loss(logits, targets):
    return None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ------------------------------------------------------------------------------------- nanoGPT
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), NanoMLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, WIDTH), wpe=nn.Embedding(SEQ, WIDTH),
            h=nn.ModuleList([NanoBlock(WIDTH, HEADS) for _ in range(LAYERS)]), ln_f=nn.LayerNorm(WIDTH)))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, _loss(logits, targets)


# -------------------------------------------------------------------------------------- minGPT
class MinAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj, self.resid_drop = nn.Linear(n_embd, n_embd), nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MinBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd), MinAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(0.1))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MinGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, WIDTH), nn.Parameter(torch.zeros(1, SEQ, WIDTH))
        self.blocks = nn.Sequential(*[MinBlock(WIDTH, HEADS) for _ in range(LAYERS)])
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb[:, : idx.size(1), :]
        logits = self.head(self.ln_f(self.blocks(x)))
        return logits, _loss(logits, targets)


# ------------------------------------------------------------------------- hand-written Llama
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos[:T], sin[:T]), _rotate(k, cos[:T], sin[:T])
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), LlamaAttention(dim, n_heads, n_kv_heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, 3 * dim)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class HandLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(LlamaBlock(WIDTH, HEADS, HEADS // 2) for _ in range(LAYERS))
        self.norm, self.output = RMSNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        head_dim = WIDTH // HEADS
        freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx, targets=None):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.output(self.norm(x))
        return logits, _loss(logits, targets)


def _fused_qkv(n_kv_heads: int):
    from tests.helpers.user_mqa_gpt import FusedQKVGPT

    return lambda: FusedQKVGPT(n_kv_heads)


#: ``fused-mqa``/``fused-gqa``: one fused ``qkv`` with 1 or 2 key/value heads (tests/helpers/user_mqa_gpt.py)
MODELS = {"nanogpt": NanoGPT, "mingpt": MinGPT, "llama": HandLlama, "fused-mqa": _fused_qkv(1), "fused-gqa": _fused_qkv(2)}


def build(name: str) -> nn.Module:
    return MODELS[name]()
