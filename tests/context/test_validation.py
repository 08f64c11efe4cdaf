"""ContextParallel.validate refuses, before any process group, what cannot be exact."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megastrategy.context import ContextParallel
from megastrategy.errors import MegatronConfigError
from tests.context import tiny_models as tm


class SoftmaxAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def _refused(model, *patterns, **kwargs):
    with pytest.raises(MegatronConfigError) as info:
        ContextParallel.validate(model, kwargs.pop("cp", 2), **kwargs)
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)


@pytest.mark.parametrize("cp", [0, -1, "2", 2.0, True])
def test_cp_must_be_a_positive_integer(cp):
    _refused(nn.Linear(2, 2), f"cp={cp!r}", cp=cp)


def test_layout_and_output_choices_are_named():
    _refused(nn.Linear(2, 2), "layout='zigzag'", "balanced", layout="zigzag")
    _refused(nn.Linear(2, 2), "output='pooled'", "sequence", output="pooled")


def test_attention_dropout_is_refused_with_the_field_to_change():
    model = tm.llama("sdpa")
    model.config.attention_dropout = 0.1
    _refused(model, "attention_dropout=0.1", "Set attention_dropout=0.0")
    bert = tm.bert("sdpa", "mlm")
    bert.config.attention_probs_dropout_prob = 0.1
    _refused(bert, "attention_probs_dropout_prob=0.1")


def test_unsupported_attention_implementation_is_named():
    model = tm.llama("sdpa")
    model.config._attn_implementation_internal = "flex_attention"
    _refused(model, "attn_implementation='flex_attention'", "attn_implementation='sdpa'")


def test_attention_that_cannot_be_intercepted_names_the_module():
    _refused(nn.Sequential(nn.Linear(8, 8), SoftmaxAttention()), "module '1' (SoftmaxAttention)", "scaled_dot_product_attention")
    _refused(nn.Sequential(nn.MultiheadAttention(8, 2)), "module '0' (nn.MultiheadAttention)")


class HelperSoftmaxAttention(SoftmaxAttention):
    """The softmax in a helper method (GPT-Neo's ``_attn``), not in ``forward``."""

    def _attn(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v

    def forward(self, x):
        return self._attn(*self.qkv(x).chunk(3, dim=-1))


class NamedImplementationAttention(SoftmaxAttention):
    """Chooses SDPA by comparing the implementation's name, as Falcon does."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.config._attn_implementation == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return torch.softmax(q @ k.transpose(-1, -2) + self.mask, dim=-1) @ v


def test_attention_in_a_helper_or_chosen_by_implementation_name_is_refused_in_setup():
    _refused(nn.Sequential(HelperSoftmaxAttention()), "(HelperSoftmaxAttention) computes attention with an explicit softmax")
    _refused(nn.Sequential(NamedImplementationAttention()), "comparing config._attn_implementation", "cp=1")


def test_gradient_checkpointing_passes_validation():
    """Its replay runs in the split microbatch (context/recompute.py; tests/context/test_recompute.py)."""
    model = tm.llama("sdpa")
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ContextParallel.validate(model, 2)


def test_sequence_head_without_an_encoder_is_refused():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    _refused(LlamaForSequenceClassification(config), "'sequence'", "output='tokens'")


def test_supported_models_pass_and_cp_1_accepts_anything():
    for model in (tm.SdpaGPT(), tm.llama("eager"), tm.llama("sdpa", sliding_window=4), tm.bert("sdpa", "classifier")):
        ContextParallel.validate(model, 4)
    ContextParallel.validate(nn.MultiheadAttention(8, 2), 1)
