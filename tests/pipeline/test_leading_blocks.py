"""A chunk's view of the layer stack counts blocks by their global index: Hugging Face decoders
pick each block's mask by ``config.layer_types[i]`` from ``enumerate(self.layers)``, so a chunk
that starts at block k must run it as block k (GPT-OSS: sliding window and full attention layers;
before the fix, pp2 trained 5.3e-3 off one device)."""
import copy

import pytest
import torch
from torch import nn

from megastrategy.anatomy import ModelAnatomy
from megastrategy.pipeline.forward_order import record_forward_order
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.leading_blocks import SkippedBlock, skipped_blocks
from megastrategy.pipeline.stage import LocalLayers, StageBoundary, cut_stage
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


@pytest.mark.parametrize("pp_rank,chunk", [(1, 0), (0, 1), (1, 1)])
def test_every_chunk_runs_its_blocks_with_their_own_masks(pp_rank, chunk):
    """GPT-OSS, 4 layers alternating sliding window 4 and full attention, 12 tokens (the masks differ),
    at pp2·vp2: rank 1 chunk 0 is block 1, rank 0 chunk 1 block 2, rank 1 chunk 1 block 3. Each gets
    the previous block's output and must compute what the whole model computes there."""
    full = tiny_model("gpt_oss", num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    ids = torch.randint(3, 128, (2, 12))
    outputs: list[torch.Tensor] = []
    hooks = [block.register_forward_hook(lambda m, a, out: outputs.append(out)) for block in full.model.layers]
    expected_logits = full(input_ids=ids).logits
    for h in hooks:
        h.remove()
    model = copy.deepcopy(full)
    order = record_forward_order(model, PATH)  # its MoE blocks run on meta too: the blocks return a bare tensor
    assert order is not None and order.block_arity == 0
    anatomy = ModelAnatomy.of(model, PATH, order.called)
    stage = cut_stage(model, stack_path=PATH, stack=anatomy.stack, assignment=assign_layers(4, 2, 2), pp_rank=pp_rank,
                      pp_size=2, vp_size=2, anatomy=anatomy, block_arity=order.block_arity)
    block = stage.chunks[chunk][0]
    stage.activate(chunk, outputs[block - 1].detach())
    try:
        if block == 3:  # the last virtual stage: the model goes on to the head
            torch.testing.assert_close(model(input_ids=ids).logits, expected_logits)
        else:
            with pytest.raises(StageBoundary) as boundary:
                model(input_ids=ids)
            torch.testing.assert_close(boundary.value.output, outputs[block])
    finally:
        stage.deactivate()
