"""An ``AveragedModel``'s copy is described in a checkpoint by the split of the submodule it averages;
sources alike in structure but split differently are refused; a resume's early check leaves a saved
average the module has not built yet to Lightning."""
import pytest
from torch import nn
from torch.optim.swa_utils import AveragedModel

from megastrategy.checkpoint.averaged_layout import averaged_sources, without_absent_averaged_models
from megastrategy.checkpoint.layout import module_layout
from megastrategy.errors import MegatronCheckpointError
from megastrategy.layers.shard_spec import ShardSpec, set_shard_spec

SPLIT = ShardSpec(dim=0, full_size=16, padded_size=16)


class WithEma(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        self.twin = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.ema = AveragedModel(self.net)


def test_a_copy_is_described_by_its_source_split_under_its_own_name():
    module = WithEma()
    set_shard_spec(module.net[0].weight, SPLIT)
    assert averaged_sources(module) == {"ema.module.": "net."}
    layout = module_layout(module, tp_rank=1, tp_size=2).tensors
    copy = layout["ema.module.0.weight"][1]
    assert copy.name == "ema.module.0.weight" and copy.spec == SPLIT and copy.tp_rank == 1
    assert not layout["ema.module.1.weight"][1].sharded and not layout["ema.n_averaged"][1].sharded


def test_alike_sources_split_alike_are_fine_split_differently_refused():
    module = WithEma()
    module.ema = AveragedModel(module.twin[0])
    assert averaged_sources(module) == {"ema.module.": "twin.0."}
    set_shard_spec(module.twin[1].weight, SPLIT)
    with pytest.raises(MegatronCheckpointError, match=r"AveragedModel at 'ema'.*\['twin.0', 'twin.1'\]"):
        averaged_sources(module)


def test_a_saved_average_the_module_lacks_yet_is_left_out_of_the_early_check():
    saved = {"net.0.weight": (8, 4), "ema.module.0.weight": (8, 4), "ema.n_averaged": (), "emb.weight": (3, 3)}
    assert without_absent_averaged_models(saved, {"net.0.weight": (8, 4)}) == {"net.0.weight": (8, 4), "emb.weight": (3, 3)}
    assert without_absent_averaged_models(saved, {"ema.n_averaged": ()}) == saved
