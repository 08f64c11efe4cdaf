"""A layer the tp plan shards may not be reparametrized (its shard would train the plain weight):
both of torch's APIs are refused by name while the plan is resolved, a replicated one passes."""
import warnings

import pytest
import torch
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.models import GPT


def _gpt(reparametrize) -> GPT:
    model = GPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the hook-based API is deprecated
        for block in model.blocks:
            reparametrize(block)
    return model


@pytest.mark.parametrize("reparametrize, found, removal", [
    (lambda b: nn.utils.parametrizations.weight_norm(b.fc), "(weight: _WeightNorm)", "remove_parametrizations"),
    (lambda b: nn.utils.parametrizations.orthogonal(b.fc), "(weight: _Orthogonal)", "remove_parametrizations"),
    (lambda b: nn.utils.weight_norm(b.fc), "(weight: WeightNorm (hook))", "remove_weight_norm"),
])
def test_a_reparametrized_sharded_layer_is_refused_naming_it_and_what_works(reparametrize, found, removal):
    with pytest.raises(MegatronConfigError) as e:
        resolve_tp_plan(_gpt(reparametrize), GPT.TP_PLAN, 2)
    text = str(e.value)
    assert text.startswith(f"tp=2: 'blocks.0.fc' is reparametrized {found} and the plan shards 'blocks.0.fc' (column")
    assert "tp_plan={'blocks.0.fc': 'replicate'}" in text and removal in text


def test_a_reparametrized_layer_kept_whole_passes():
    plan = {**GPT.TP_PLAN, "blocks.*.fc": "replicate", "blocks.*.out": "replicate"}
    styles = resolve_tp_plan(_gpt(lambda b: nn.utils.parametrizations.spectral_norm(b.fc)), plan, 2).styles()
    assert styles["blocks.0.fc"] == "replicate" and styles["blocks.0.q"] == "column"
    assert torch.nn.utils.parametrize.is_parametrized(_gpt(lambda b: nn.utils.parametrizations.weight_norm(b.fc)).blocks[0].fc)
