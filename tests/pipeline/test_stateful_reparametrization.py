"""Under pp a reparametrization that updates its buffers in every forward (spectral_norm's power
iteration) is refused in setup; stateless ones (weight_norm) pass."""
import warnings

import pytest
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.stateful_reparametrization import refuse_stateful_reparametrization


def _mlp(reparametrize) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        reparametrize(model[2])
    return model


@pytest.mark.parametrize("reparametrize, found", [
    (nn.utils.parametrizations.spectral_norm, "weight: _SpectralNorm"),
    (nn.utils.spectral_norm, "weight: SpectralNorm (hook)"),
])
def test_spectral_norm_is_refused_naming_the_layer(reparametrize, found):
    with pytest.raises(MegatronConfigError) as e:
        refuse_stateful_reparametrization(_mlp(reparametrize), 2)
    assert str(e.value).startswith(f"pp=2: '2' is reparametrized by {found}, which updates its own buffers")


@pytest.mark.parametrize("reparametrize", [nn.utils.parametrizations.weight_norm, nn.utils.weight_norm,
                                           nn.utils.parametrizations.orthogonal])
def test_stateless_reparametrizations_pass(reparametrize):
    refuse_stateful_reparametrization(_mlp(reparametrize), 2)
