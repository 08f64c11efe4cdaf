"""An encoder-decoder's refusals, and which ranks hold a copy of its shared embedding."""
import pytest
import torch
import transformers

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.seq2seq_checks import Seq2SeqTied, refuse_seq2seq_layout
from megastrategy.pipeline.seq2seq_layout import seq2seq_layout


class Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


@pytest.fixture(scope="module")
def layout():
    config = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8)
    return seq2seq_layout(Wrapper(transformers.T5ForConditionalGeneration(config)))


def tied(layout, pp, vp, rank):
    return Seq2SeqTied.build(layout, assign_layers(4, pp, vp), StagePlacement.build("ring", pp, vp), rank)


def test_the_shared_embedding_is_summed_over_the_embedding_group_when_the_seam_is_on_an_end(layout):
    for pp, vp in ((2, 1), (2, 2)):  # the seam stage is the last one, or on rank 0 beside the first
        assert not tied(layout, pp, vp, 0).beyond_ends
    first, last = tied(layout, 2, 1, 0), tied(layout, 2, 1, 1)
    assert [p is layout.pre[0].module.weight for p, _ in first.entries] == [True]  # model.shared.weight
    assert [p is not None for p, _ in last.entries] == [True]


def test_a_middle_seam_stage_sums_over_the_pipeline_with_zeros_where_no_copy_is(layout):
    # pp=4, one block per stage: encoder 0 | encoder 1 | decoder 0 (seam) | decoder 1
    middle, outside = tied(layout, 4, 1, 2), tied(layout, 4, 1, 1)
    assert middle.beyond_ends and outside.beyond_ends
    assert [p is not None for p, _ in middle.entries] == [True]
    assert [(p, tuple(shape)) for p, shape in outside.entries] == [(None, (64, 16))]


def test_a_stack_the_user_names_is_refused_naming_the_fix(layout):
    with pytest.raises(MegatronConfigError, match=r"pipeline_layers='model.encoder.block' with an encoder-decoder.*unset"):
        refuse_seq2seq_layout(layout, "model.encoder.block")
    refuse_seq2seq_layout(layout, None)


def test_a_stage_starting_where_the_loop_hands_a_computed_plain_value_is_refused(layout):
    import dataclasses

    from megastrategy.pipeline.seq2seq_checks import refuse_seq2seq_loop_state

    refuse_seq2seq_loop_state(layout, assign_layers(4, 4), 4)  # T5's loops hand every block the same plain values
    decoder = dataclasses.replace(layout.orders[1], loop_state=((1, "depth", 1, 0),))
    changed = dataclasses.replace(layout, orders=(layout.orders[0], decoder))
    refuse_seq2seq_loop_state(changed, assign_layers(4, 2), 2)  # pp=2 starts no stage at decoder block 1
    with pytest.raises(MegatronConfigError, match=r"pp=4: a pipeline stage would start at block 1 of model.decoder.block"):
        refuse_seq2seq_loop_state(changed, assign_layers(4, 4), 4)
