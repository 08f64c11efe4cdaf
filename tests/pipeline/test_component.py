"""The pipeline component refuses, before any collective, what its schedule cannot honour."""
import pytest

from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.component import Pipeline
from tests.helpers.models import GPT


def test_manual_optimization_under_pp_is_refused_naming_the_fix():
    module = GPT(n_layer=4)
    module.automatic_optimization = False
    with pytest.raises(MegatronConfigError, match=r"automatic_optimization=False with pp=2.*pp=1"):
        Pipeline(MegatronConfig(pp=2)).validate(module, None)


def test_automatic_optimization_with_enough_layers_passes():
    Pipeline(MegatronConfig(pp=2)).validate(GPT(n_layer=4), None)
    with pytest.raises(MegatronConfigError, match="layers"):
        Pipeline(MegatronConfig(pp=4)).validate(GPT(n_layer=2), None)
