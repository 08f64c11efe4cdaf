"""A stack whose blocks are spread over parallel lists (XLM/Flaubert: attentions[i], ffns[i], ...) is
refused in setup; a single list of whole blocks passes."""
import pytest
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.parallel_lists import refuse_parallel_lists


class XLMLike(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.attentions = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))
        self.ffns = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))
        self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(n - 1))  # another length: not parallel


def test_parallel_lists_are_refused_naming_every_list():
    with pytest.raises(MegatronConfigError) as e:
        refuse_parallel_lists(XLMLike(), "attentions", pp=2)
    assert "'attentions', 'ffns'" in str(e.value) and "heads" not in str(e.value) and "pp=1" in str(e.value)


def test_one_list_of_whole_blocks_passes():
    model = XLMLike()
    del model.ffns
    refuse_parallel_lists(model, "attentions", pp=2)
