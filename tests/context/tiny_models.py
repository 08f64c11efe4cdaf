"""Tiny models and batches for the context-parallel equivalence tests (fp32, dropout off)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH = 61, 16, 2


class SdpaBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class SdpaGPT(nn.Module):
    """A hand-written GPT: learned positions (taken from position_ids when given), SDPA causal attention."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2, max_len: int = 64):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(SdpaBlock(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        x = self.tokens(input_ids) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def gpt_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    targets = ids[:, 1:].clone()
    targets[0, 3:9] = -100  # unequal valid-token counts per rank: the mean must be global
    return {"input_ids": ids[:, :-1], "targets": targets}


def gpt_loss(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1)), logits


def llama(attn: str, sliding_window=None, **config):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **config)
    if sliding_window is not None:
        config = MistralConfig(**common, sliding_window=sliding_window, attn_implementation=attn)
        return MistralForCausalLM(config)
    return LlamaForCausalLM(LlamaConfig(**common, attn_implementation=attn))


def lm_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[1, 2:7] = -100
    return {"input_ids": ids, "labels": labels}


def lm_loss(model, batch):
    out = model(**batch)
    return out.loss, out.logits


def bert(attn: str, head: str):
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation=attn)
    return BertForSequenceClassification(config) if head == "classifier" else BertForMaskedLM(config)


def bert_batch(seed: int, head: str):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, 11:] = 0
    mask[1, 5:] = 0  # padding reaches into every rank's chunk
    if head == "classifier":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}
    labels = torch.where(mask.bool() & (torch.arange(SEQ) % 3 == 0), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
