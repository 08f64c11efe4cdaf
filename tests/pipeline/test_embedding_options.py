"""``nn.Embedding`` options that would count a microbatch or renormalize one of two tied copies under pp
are refused in setup (pipeline/embedding_options.py); what stays exact passes."""
import pytest
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.embedding_options import refuse_embedding_options


class Tied(nn.Module):
    def __init__(self, tie: bool, **options):
        super().__init__()
        self.emb = nn.Embedding(11, 4, **options)
        self.head = nn.Linear(4, 11, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_scale_grad_by_freq_is_refused_with_several_microbatches_only():
    with pytest.raises(MegatronConfigError, match=r"pp=2 with num_microbatches=4: 'emb' is "
                                                  r"nn.Embedding\(scale_grad_by_freq=True\).*num_microbatches=1"):
        refuse_embedding_options(Tied(False, scale_grad_by_freq=True), 2, 4)
    refuse_embedding_options(Tied(True, scale_grad_by_freq=True), 2, 1)


def test_max_norm_is_refused_when_the_weight_is_tied_only():
    with pytest.raises(MegatronConfigError, match=r"'emb' is nn.Embedding\(max_norm=1.0\) and its weight is tied "
                                                  r"to 'head'.*Untie them"):
        refuse_embedding_options(Tied(True, max_norm=1.0), 2, 4)
    refuse_embedding_options(Tied(False, max_norm=1.0), 2, 4)
    refuse_embedding_options(Tied(True), 2, 4)
