"""BatchNorm under pp with several microbatches is refused in setup (it would normalize each
microbatch by its own statistics and differ silently from one device); one microbatch is accepted."""
import pytest
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.batch_statistics import refuse_batch_statistics


def _convnet(norm: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.ReLU(), nn.Flatten())


def test_batch_norm_with_microbatches_is_refused_naming_the_layer_and_what_works():
    with pytest.raises(MegatronConfigError) as e:
        refuse_batch_statistics(_convnet(nn.BatchNorm2d(8)), pp=2, num_microbatches=2)
    text = str(e.value)
    assert "'1' (BatchNorm2d)" in text and "num_microbatches=1" in text and "GroupNorm" in text


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 8), nn.LayerNorm([8, 6, 6]), nn.SyncBatchNorm(8)])
def test_other_norms_pass_and_sync_batch_norm_is_refused_too(norm):
    if isinstance(norm, nn.SyncBatchNorm):
        with pytest.raises(MegatronConfigError):
            refuse_batch_statistics(_convnet(norm), pp=2, num_microbatches=4)
    else:
        refuse_batch_statistics(_convnet(norm), pp=2, num_microbatches=4)


def test_one_microbatch_is_the_whole_batch_so_batch_norm_is_exact():
    refuse_batch_statistics(_convnet(nn.BatchNorm2d(8)), pp=2, num_microbatches=1)
