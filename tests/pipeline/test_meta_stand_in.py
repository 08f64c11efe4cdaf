"""A module that runs before the layer stack is replaced, on later stages, by a stand-in that returns
zeros of the real output's shape: its meta run is done once per input signature, not per microbatch."""
import torch
from torch import nn

from megastrategy.pipeline.stage import MetaStandIn


class _Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50, 8)
        self.runs = 0

    def forward(self, ids, scale=1.0, extra=None):
        self.runs += 1
        return self.table(ids) * scale, ids.shape[-1]


def _stand_in():
    stand_in = MetaStandIn(_Embedding(), "embeddings")
    return stand_in, stand_in._meta[0]


def test_output_has_the_real_shape_and_zeros_and_is_a_fresh_tensor_each_call():
    stand_in, meta = _stand_in()
    ids = torch.randint(0, 50, (2, 5))
    first, length = stand_in(ids)
    second, _ = stand_in(ids + 1)
    assert first.shape == (2, 5, 8) and first.dtype == torch.float32 and length == 5
    assert first.device == ids.device and not first.any()
    assert first.data_ptr() != second.data_ptr()  # fresh zeros: code may write into them
    assert meta.runs == 1  # the same shapes again: the meta run is remembered


def test_a_new_shape_or_plain_argument_runs_the_meta_copy_again():
    stand_in, meta = _stand_in()
    stand_in(torch.zeros(2, 5, dtype=torch.long))
    out, length = stand_in(torch.zeros(2, 7, dtype=torch.long))
    assert out.shape == (2, 7, 8) and length == 7
    stand_in(torch.zeros(2, 7, dtype=torch.long), scale=2.0)
    stand_in(torch.zeros(2, 7, dtype=torch.long), scale=2.0)
    assert meta.runs == 3


def test_an_object_argument_is_never_remembered():
    stand_in, meta = _stand_in()
    for _ in range(3):
        stand_in(torch.zeros(2, 5, dtype=torch.long), extra=object())
    assert meta.runs == 3 and not stand_in._outputs


def test_the_forward_can_read_the_replaced_modules_attributes():
    """ViT's forward reads ``self.embeddings.patch_embeddings.projection.weight.dtype`` on every
    stage: the stand-in answers from its meta copy (real shapes and dtypes, no memory)."""
    stand_in, _ = _stand_in()
    assert stand_in.table.weight.dtype == torch.float32 and stand_in.table.weight.shape == (50, 8)
    assert stand_in.table.weight.is_meta and not list(stand_in.parameters())
    assert stand_in.runs == 0


def test_calling_a_part_of_the_replaced_module_is_refused_naming_it():
    """Reading is fine; a call would compute on the meta device, so it is refused clearly."""
    import pytest

    from megastrategy.errors import MegatronConfigError

    stand_in, _ = _stand_in()
    stand_in(torch.zeros(2, 5, dtype=torch.long))  # its own run calls the table: allowed
    with pytest.raises(MegatronConfigError, match=r"calls embeddings\.table directly"):
        stand_in.table(torch.zeros(2, 5, dtype=torch.long))


def test_inputs_moved_to_the_stand_ins_meta_weight_give_zeros_on_the_real_device():
    """Llama 4 calls ``embed_tokens(input_ids.to(embed_tokens.weight.device))``: on a later stage the
    weight is the meta copy's, so the ids arrive on meta; the zeros go where the real module was."""
    stand_in, _ = _stand_in()
    ids = torch.randint(0, 50, (2, 5))
    out, _ = stand_in(ids.to(stand_in.table.weight.device))
    assert stand_in.table.weight.device.type == "meta" and out.device.type == "cpu" and not out.any()
