"""Vocab-parallel embedding and head of a user's own transformer only where exact
(megastrategy.layers.user_vocab). Pure: plans are resolved, nothing is sharded."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.user_gpts import NanoGPT, build


def _vocab(model):
    return {e.name: dict(e.extra).get("tied_to") for e in resolve_tp_plan(model, None, 2).entries if e.style == "vocab"}


def test_tied_and_untied_pairs_are_vocab_parallel():
    assert _vocab(build("nanogpt")) == {"transformer.wte": None, "lm_head": "transformer.wte"}
    assert _vocab(build("llama")) == {"tok_embeddings": None, "output": None}


class FunctionalTie(NanoGPT):
    """The head applied as ``x @ wte.weight.T``: the weight is read outside its layer."""

    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx)
        x = self.transformer.ln_f(self.transformer.wte(idx))
        return logits + x @ self.transformer.wte.weight.T, None


class ScaledLookup(NanoGPT):
    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx)
        return logits + F.embedding(idx, self.lm_head.weight).sum(-1, keepdim=True), None


def test_a_weight_read_outside_its_layer_leaves_both_replicated():
    assert _vocab(FunctionalTie()) == {} and _vocab(ScaledLookup()) == {}
    plan = resolve_tp_plan(FunctionalTie(), None, 2)
    assert plan["transformer.h.0.mlp.c_fc"].style == "column"  # the blocks are still read


def test_an_ambiguous_vocabulary_leaves_both_replicated():
    model = NanoGPT()
    model.transformer.wpe = torch.nn.Embedding(64, 32)  # as large as the vocabulary
    assert _vocab(model) == {}
