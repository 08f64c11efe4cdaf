"""A chunk's view of the layer stack counts blocks by their global index: Hugging Face decoders
pick each block's mask by ``config.layer_types[i]`` from ``enumerate(self.layers)``, so a stage
that starts at block 1 must run it as block 1 (GPT-OSS: sliding window, then full attention)."""
import copy

import torch
from torch import nn

from megastrategy.anatomy import ModelAnatomy
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.leading_blocks import SkippedBlock
from megastrategy.pipeline.stage import LocalLayers, cut_stage
from tests.helpers.hf_zoo import tiny_model

PATH = "model.layers"


def test_the_view_puts_placeholders_before_the_chunk_and_keeps_them_out_of_the_parameters():
    blocks = {2: nn.Linear(3, 3), 3: nn.Linear(3, 3)}
    skipped = [SkippedBlock(i, nn.Linear(3, 3), arity=None) for i in range(2)]
    view = LocalLayers(blocks, skipped)
    assert [i for i, _ in enumerate(view)] == [0, 1, 2, 3] and len(view) == 4
    assert view[2] is blocks[2] and view[0] is skipped[0] and list(view[:3])[2] is blocks[2]
    assert len(list(view.parameters())) == 4 and set(view.state_dict()) == {"2.weight", "2.bias", "3.weight", "3.bias"}
    x = torch.randn(2, 3)
    assert view[1](x) is x and view[1].in_features == 3  # hands its input on; attributes from a meta copy
    assert SkippedBlock(0, nn.Linear(3, 3), arity=3)(x) == (x, None, None)


def test_a_stage_starting_at_a_full_attention_block_uses_its_mask_not_the_first_blocks():
    full = tiny_model("gpt_oss")  # layer_types: sliding window 4, then full; 12 tokens: the masks differ
    ids = torch.randint(3, 128, (2, 12))
    hidden: list[torch.Tensor] = []
    full.model.layers[0].register_forward_hook(lambda m, a, out: hidden.append(out))
    expected = full(input_ids=ids).logits
    last = copy.deepcopy(full)
    last.model.layers[0]._forward_hooks.clear()
    anatomy = ModelAnatomy.of(last, PATH)
    stage = cut_stage(last, stack_path=PATH, stack=anatomy.stack, assignment=assign_layers(2, 2), pp_rank=1,
                      pp_size=2, vp_size=1, anatomy=anatomy)
    stage.activate(0, hidden[0].detach())
    got = last(input_ids=ids).logits
    stage.deactivate()
    torch.testing.assert_close(got, expected)
