"""``refuse_shard_statistics``: which optimizers are refused on which layouts (by class name)."""
from types import SimpleNamespace

import pytest
import torch

from megastrategy.ddp.shard_statistics_refusal import refuse_shard_statistics
from megastrategy.errors import MegatronConfigError

PARAMS = [torch.nn.Parameter(torch.ones(2, 2))]


def _config(tp=1, pp=1, zero1=False):
    return SimpleNamespace(tp=tp, pp=pp, use_distributed_optimizer=zero1)


class Lamb(torch.optim.SGD):  # a third-party name, recognised by its class name
    pass


@pytest.mark.parametrize("optimizer,config,dp", [
    (torch.optim.Adafactor(PARAMS), _config(tp=2), 1),
    (torch.optim.Adafactor(PARAMS), _config(zero1=True), 2),
    (Lamb(PARAMS, lr=0.1), _config(tp=2), 1),
    (torch.optim.LBFGS(PARAMS), _config(pp=2), 1),
    (torch.optim.LBFGS(PARAMS), _config(zero1=True), 2),
])
def test_refused(optimizer, config, dp):
    with pytest.raises(MegatronConfigError, match=f"returned {type(optimizer).__name__}"):
        refuse_shard_statistics([optimizer], config, dp)


@pytest.mark.parametrize("optimizer,config,dp", [
    (torch.optim.Adafactor(PARAMS), _config(pp=2), 2),
    (torch.optim.LBFGS(PARAMS), _config(), 2),
    (torch.optim.AdamW(PARAMS), _config(tp=2, pp=2, zero1=True), 2),
    (torch.optim.Adafactor(PARAMS), _config(zero1=True), 1),
])
def test_allowed(optimizer, config, dp):
    refuse_shard_statistics([optimizer], config, dp)
