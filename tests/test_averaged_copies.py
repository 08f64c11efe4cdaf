"""An ``AveragedModel`` made before the split is taken out and remade from its split source (with its
averaged values cut the same way); one whose source cannot be told is refused by name. The checkpoint
describes a copy's tensors by its source's (the launches: tests/test_user_habits_round3.py)."""
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from megastrategy.averaged_copies import hold_averaged_copies, refuse_unsharded_averaged_models, remake_averaged_copies
from megastrategy.checkpoint.layout import module_layout
from megastrategy.errors import MegatronConfigError


class WithEma(nn.Module):
    """A net, a twin of two alike layers, and an EMA of the net (or of ``source``)."""

    def __init__(self, source="net"):  # "outside": a module that is not part of this one
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        self.twin = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.ema = AveragedModel(nn.Linear(3, 3) if source == "outside" else getattr(self, source))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("source, count", [("outside", "0"), ("twin.0", "2")])  # twin.0 and twin.1 look alike
def test_an_averaged_model_whose_source_cannot_be_told_is_refused_naming_it(tp, pp, source, count):
    module = WithEma()
    module.ema = AveragedModel(nn.Linear(3, 3) if source == "outside" else module.get_submodule(source))
    with pytest.raises(MegatronConfigError, match=rf"AveragedModel registered at 'ema'.*structure of {count}"):
        refuse_unsharded_averaged_models(module, tp, pp)


def test_one_of_a_unique_structure_is_kept_and_data_parallelism_keeps_any():
    refuse_unsharded_averaged_models(WithEma(), 2, 1)
    refuse_unsharded_averaged_models(WithEma("outside"), 1, 1)


def test_held_copy_is_remade_from_the_source_with_its_own_values():
    module = WithEma()
    with torch.no_grad():
        module.ema.module[0].weight.fill_(3.0)
    module.ema.module[1].requires_grad_(False)
    held = hold_averaged_copies(module)
    assert [(p, s) for p, s, _, _ in held] == [("ema", "net")] and not list(module.ema.module.parameters())
    remake_averaged_copies(module, held, lambda m: module_layout(m))
    assert module.ema.module[0].weight is not module.net[0].weight
    assert torch.equal(module.ema.module[0].weight, torch.full((8, 4), 3.0))
    assert torch.equal(module.ema.module[1].bias, module.net[1].bias)
    assert module.ema.module[0].weight.requires_grad and not module.ema.module[1].bias.requires_grad
