"""An ``AveragedModel`` built in ``__init__`` is refused at tp or pp > 1 with what works instead
(the launches with SWA and an EMA built in ``on_fit_start`` are in tests/test_user_habits_round3.py)."""
import pytest
from torch import nn
from torch.optim.swa_utils import AveragedModel

from megastrategy.averaged_copies import refuse_unsharded_averaged_models
from megastrategy.errors import MegatronConfigError


class WithEma(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        self.ema = AveragedModel(self.net)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_an_averaged_model_made_in_init_is_refused_naming_it_and_the_fix(tp, pp):
    with pytest.raises(MegatronConfigError, match=r"AveragedModel registered at 'ema'.*on_fit_start"):
        refuse_unsharded_averaged_models(WithEma(), tp, pp)


def test_data_parallelism_alone_keeps_it():
    refuse_unsharded_averaged_models(WithEma(), 1, 1)
