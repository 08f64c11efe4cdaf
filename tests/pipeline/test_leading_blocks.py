"""A chunk's view of the layer stack counts blocks by their global index: Hugging Face decoders
pick each block's mask by ``config.layer_types[i]`` from ``enumerate(self.layers)``, so a stage
that starts at block 1 must run it as block 1 (GPT-OSS: sliding window, then full attention)."""
import copy

import torch
from torch import nn

from megastrategy.anatomy import ModelAnatomy
from megastrategy.pipeline.forward_order import record_forward_order
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.leading_blocks import SkippedBlock, skipped_blocks
from megastrategy.pipeline.stage import LocalLayers, cut_stage
from tests.helpers.hf_zoo import tiny_model

PATH = "model.layers"


def test_the_view_puts_placeholders_before_the_chunk_and_keeps_them_out_of_the_parameters():
    blocks = {2: nn.Linear(3, 3), 3: nn.Linear(3, 3)}
    skipped = [SkippedBlock(i, nn.Linear(3, 3), arity=0) for i in range(2)]
    view = LocalLayers(blocks, skipped)
    assert [i for i, _ in enumerate(view)] == [0, 1, 2, 3] and len(view) == 4
    assert view[2] is blocks[2] and view[0] is skipped[0] and list(view[:3])[2] is blocks[2]
    assert len(list(view.parameters())) == 4 and set(view.state_dict()) == {"2.weight", "2.bias", "3.weight", "3.bias"}
    x = torch.randn(2, 3)
    assert view[1](x) is x and view[1].in_features == 3  # hands its input on; attributes from a meta copy
    assert SkippedBlock(0, nn.Linear(3, 3), arity=3)(x) == (x, None, None)


def test_without_a_dry_run_the_view_holds_the_chunks_blocks_only():
    """A module that is not a Hugging Face model: the blocks' output structure is unknown."""
    stack = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
    assert skipped_blocks(stack, 2, arity=None) == [] and len(skipped_blocks(stack, 2, arity=0)) == 2


def test_a_stage_starting_at_a_full_attention_block_uses_its_mask_not_the_first_blocks():
    full = tiny_model("gpt_oss")  # layer_types: sliding window 4, then full; 12 tokens: the masks differ
    ids = torch.randint(3, 128, (2, 12))
    hidden: list[torch.Tensor] = []
    full.model.layers[0].register_forward_hook(lambda m, a, out: hidden.append(out))
    expected = full(input_ids=ids).logits
    last = copy.deepcopy(full)
    last.model.layers[0]._forward_hooks.clear()
    order = record_forward_order(last, PATH)  # its MoE blocks run on meta too: the blocks return a bare tensor
    assert order is not None and order.block_arity == 0
    anatomy = ModelAnatomy.of(last, PATH, order.called)
    stage = cut_stage(last, stack_path=PATH, stack=anatomy.stack, assignment=assign_layers(2, 2), pp_rank=1,
                      pp_size=2, vp_size=1, anatomy=anatomy, block_arity=order.block_arity)
    stage.activate(0, hidden[0].detach())
    got = last(input_ids=ids).logits
    stage.deactivate()
    torch.testing.assert_close(got, expected)
