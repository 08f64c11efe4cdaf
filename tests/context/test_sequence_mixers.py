"""Models that mix tokens outside attention are refused by ContextParallel.validate, before any
process group, naming the config field or module (sequence_mixers.py)."""
from __future__ import annotations

import pytest
from torch import nn

from megastrategy.context import ContextParallel
from megastrategy.errors import MegatronConfigError
from tests.context import tiny_models as tm


def _refused(model, *patterns):
    with pytest.raises(MegatronConfigError) as info:
        ContextParallel.validate(model, 2)
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)


class ShortConv(nn.Module):
    """A causal depthwise convolution over the sequence, as in Mamba or LFM2 blocks."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, kernel_size=4, groups=8, padding=3)


def test_a_convolution_along_the_sequence_is_refused_naming_the_module():
    _refused(nn.Sequential(nn.Linear(8, 8), ShortConv()), "module '1.conv' (Conv1d, kernel_size=4)", "cp=1")


def test_a_recurrence_and_a_shift_are_refused():
    _refused(nn.Sequential(nn.GRU(8, 8)), "module '0' (GRU, a recurrence)")
    _refused(nn.Sequential(nn.ZeroPad2d((0, 0, 1, -1))), "(ZeroPad2d, a shift along the sequence)")


def test_a_pointwise_convolution_passes():
    ContextParallel.validate(nn.Sequential(nn.Conv1d(8, 8, kernel_size=1)), 2)


def test_a_layer_kind_that_is_not_attention_is_refused_naming_the_field():
    model = tm.llama("sdpa")
    model.config.layer_types = ["full_attention", "linear_attention"]
    _refused(model, "layer_types[1]='linear_attention' (LlamaConfig)", "cp=1")


def test_attention_layer_kinds_pass():
    model = tm.llama("sdpa", sliding_window=4)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    ContextParallel.validate(model, 2)


class ScanLM(nn.Module):
    """Shaped like a Hugging Face model (config, base_model_prefix) whose tokens mix by a running sum."""

    base_model_prefix = "scan"

    def __init__(self):
        super().__init__()
        self.config = object()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).cumsum(dim=1)


def test_a_hugging_face_model_without_attention_is_refused():
    _refused(nn.Sequential(ScanLM()), "'0' (ScanLM) with cp > 1 has no attention module")
