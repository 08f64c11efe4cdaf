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


def test_a_checkpoint_holding_an_average_built_after_setup_is_warned_about_once():
    import warnings

    from megastrategy.averaged_copies import warn_averaged_models_in_checkpoint

    module = WithEma()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_averaged_models_in_checkpoint(module, 2, 1)
        warn_averaged_models_in_checkpoint(module, 2, 1)
        warn_averaged_models_in_checkpoint(WithEma(), 1, 1)
    assert len(seen) == 1 and "AveragedModel at 'ema'" in str(seen[0].message)
