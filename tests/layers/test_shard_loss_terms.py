"""A training loss that reads tensor-parallel shards outside their layers' forward (shard_loss_terms.py),
one process: the shard spec is what marks a parameter sharded, so plain layers carrying one stand for
the parallel layers here; the launched habit (tp2 against DDP) is in tests/test_user_habits_round8.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megastrategy.component import StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.shard_loss_terms import ShardLossTerms
from megastrategy.layers.shard_spec import ShardSpec, set_shard_spec

TRAINING = StepInfo("training_step", 1)


class Net(nn.Module):
    """``fc`` sharded (column-like), ``norm`` replicated."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.fc, self.head = nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 3)
        for p in (self.fc.weight, self.fc.bias):
            set_shard_spec(p, ShardSpec(dim=0, full_size=16, padded_size=16))

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.norm(x))))


def _step(net: nn.Module, loss_of, tp: int = 2, pp: int = 1) -> ShardLossTerms:
    terms = ShardLossTerms(MegatronConfig(tp=tp, pp=pp))
    terms.configure(SimpleNamespace(module=net))
    terms.begin_step(net, TRAINING)
    terms.check(loss_of(net, torch.randn(5, 4)))
    terms.end_step(net, TRAINING)
    return terms


def _cross_entropy(net, x):
    return F.cross_entropy(net(x), torch.tensor([0, 1, 2, 0, 1]))


def test_a_penalty_over_self_parameters_is_refused_naming_the_shards():
    def penalized(net, x):
        return _cross_entropy(net, x) + 0.05 * sum(p.pow(2).sum() for p in net.parameters())

    with pytest.raises(MegatronConfigError) as raised:
        _step(Net(), penalized)
    message = str(raised.value)
    assert message.startswith("tp=2: training_step returned a loss that reads tensor-parallel shards outside their")
    assert "fc.weight (read by PowBackward0), fc.bias (read by PowBackward0)" in message
    assert "norm.weight" not in message and "head.weight" not in message  # replicated: counted as one device does
    assert "weight_decay" in message and "'replicate'" in message


def test_a_shard_read_by_the_steps_own_matmul_is_refused():
    """Functional tying in the step (``h @ W.T``) sees one rank's rows, as the penalty does."""
    def tied(net, x):
        return (net.norm(x) @ net.fc.weight.T).sum()

    with pytest.raises(MegatronConfigError, match=r"fc.weight \(read by "):
        _step(Net(), tied)


@pytest.mark.parametrize("loss_of", [
    _cross_entropy,
    lambda net, x: _cross_entropy(net, x) + 0.05 * net.norm.weight.pow(2).sum(),  # replicated parameters
    lambda net, x: checkpoint(net, x, use_reentrant=False).sum(),  # activation checkpointing
    lambda net, x: checkpoint(net, x.requires_grad_(), use_reentrant=True).sum(),
])
def test_shards_read_through_their_layers_forward_pass(loss_of):
    _step(Net(), loss_of)


def test_only_the_first_training_step_is_read_and_the_hooks_are_removed():
    net = Net()
    terms = _step(net, _cross_entropy)
    assert not net.fc._forward_pre_hooks and not net.fc._forward_hooks
    terms.begin_step(net, TRAINING)
    assert terms._spans is None


def test_enabled_at_tp_without_pipeline_only():
    """pp > 1 refuses a stage's own terms itself (pipeline/local_loss_terms.py)."""
    assert ShardLossTerms(MegatronConfig(tp=2)).enabled
    assert not ShardLossTerms(MegatronConfig(tp=2, pp=2)).enabled
    assert not ShardLossTerms(MegatronConfig(pp=2)).enabled


def test_the_strategys_attention_reading_its_in_proj_weight_passes():
    """``TensorParallelMultiheadAttention`` slices ``in_proj.weight`` for cross-attention itself."""
    from megastrategy.layers.attention import TensorParallelMultiheadAttention

    torch.manual_seed(0)
    mha = TensorParallelMultiheadAttention.from_module(nn.MultiheadAttention(8, 2, batch_first=True), group=None)
    q, kv = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    _step(mha, lambda net, x: net(q, kv, kv, need_weights=False)[0].sum())


def test_a_term_with_no_gradient_passes_its_value_is_zero_on_any_layout():
    """``loss + 0 * sum(p.sum() ...)``: DDP's old trick for unused parameters."""
    _step(Net(), lambda net, x: _cross_entropy(net, x) + 0 * sum(p.sum() for p in net.parameters()))
