"""A stage cut from an unchanged Hugging Face model hands the next stage everything its first
block needs: T5's blocks pass the position bias block 0 computed, with gradients back to it."""
import copy

import pytest
import torch
import transformers

from megastrategy.anatomy import ModelAnatomy
from megastrategy.pipeline.forward_order import record_forward_order
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.stage import StageBoundary, cut_stage

PATH = "encoder.block"


def _t5_encoder() -> transformers.T5EncoderModel:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=4, num_heads=2, d_kv=8, dropout_rate=0.0)
    return transformers.T5EncoderModel(config)


def _stage(model, pp_rank: int):
    order = record_forward_order(model, PATH)
    assert order.carried == ((1, "position_bias"),)
    anatomy = ModelAnatomy.of(model, PATH, order.called)
    return cut_stage(model, stack_path=PATH, stack=anatomy.stack, assignment=assign_layers(4, 2), pp_rank=pp_rank,
                     pp_size=2, vp_size=1, anatomy=anatomy, carried=order.carried,
                     block_arity=order.block_arity)


def test_position_bias_crosses_the_boundary_and_gets_its_gradient():
    full, ids = _t5_encoder(), torch.randint(0, 64, (2, 7))
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    first_stage, last_stage = _stage(first, 0), _stage(last, 1)
    expected = full(input_ids=ids).last_hidden_state
    expected.pow(2).mean().backward()

    first_stage.activate(0, None)
    with pytest.raises(StageBoundary) as boundary:
        first(input_ids=ids)
    first_stage.deactivate()
    sent = boundary.value.output
    received = sent.detach().requires_grad_(True)
    last_stage.activate(0, received)
    got = last(input_ids=ids).last_hidden_state
    last_stage.deactivate()
    assert torch.allclose(got, expected, atol=1e-6)  # without the bias, stage 1's blocks would use none

    got.pow(2).mean().backward()
    torch.autograd.backward(sent, received.grad)
    bias_grad = first.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad
    expected_grad = full.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad
    assert torch.allclose(bias_grad, expected_grad, atol=1e-6)  # includes what stage 1's blocks added


def test_a_module_whose_weight_every_layer_reads_is_refused_on_stages_without_it():
    """DeBERTa-v2 reads ``encoder.rel_embeddings.weight`` (registered after its stack) in every
    layer without calling the module; stage 0 cannot own it, so the read is refused, loudly."""
    from megastrategy.errors import MegatronConfigError

    torch.manual_seed(0)
    config = transformers.DebertaV2Config(vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                                          intermediate_size=32, relative_attention=True, position_buckets=8,
                                          max_relative_positions=16, pos_att_type=["p2c", "c2p"])
    model, path = transformers.DebertaV2Model(config), "encoder.layer"
    anatomy = ModelAnatomy.of(model, path, record_forward_order(model, path).called)
    stage = cut_stage(model, stack_path=path, stack=anatomy.stack, assignment=assign_layers(4, 2), pp_rank=0,
                      pp_size=2, vp_size=1, anatomy=anatomy)
    stage.activate(0, None)
    with pytest.raises(MegatronConfigError, match=r"encoder\.rel_embeddings\.weight .*pp=1"):
        model(input_ids=torch.randint(0, 64, (2, 7)))
    stage.deactivate()
    assert not hasattr(model.encoder.rel_embeddings, "weight")  # a probe still just answers no


class _HeadFirst(torch.nn.Module):
    """A user's module that registers its head before the Hugging Face backbone it follows, and an
    input projection after the backbone it feeds: no dry run sees either, so registration places them."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 2)
        config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=16)
        self.encoder = transformers.BertModel(config)
        self.in_proj = torch.nn.Embedding(64, 16)


@pytest.mark.parametrize("pp_rank, call, fix", [
    (1, lambda m, ids: m.head(m.encoder(input_ids=ids).last_hidden_state), r"head is registered before .*below"),
    (0, lambda m, ids: m.encoder(inputs_embeds=m.in_proj(ids)), r"in_proj is registered after .*above"),
])
def test_a_module_placed_by_registration_but_called_on_the_other_side_says_to_move_its_line(pp_rank, call, fix):
    from megastrategy.errors import MegatronConfigError

    model, path = _HeadFirst(), "encoder.encoder.layer"
    anatomy = ModelAnatomy.of(model, path, record_forward_order(model, path).called)
    stage = cut_stage(model, stack_path=path, stack=anatomy.stack, assignment=assign_layers(4, 2), pp_rank=pp_rank,
                      pp_size=2, vp_size=1, anatomy=anatomy)
    stage.activate(0, torch.zeros(2, 7, 16) if pp_rank else None)
    with pytest.raises(MegatronConfigError, match=fix + r".* in __init__"):
        call(model, torch.randint(0, 64, (2, 7)))
    stage.deactivate()


def test_a_model_editing_its_microbatch_in_place_keeps_the_other_microbatches_backward():
    """FSMT fills the labels' -100 with padding in place: every microbatch does it to its rows, and
    the first microbatch's saved labels must still be valid in its backward; the writes reach the batch."""
    from megastrategy.pipeline.stage import iter_microbatches

    batch = {"labels": torch.tensor([[1, -100], [2, 3], [-100, 4], [5, 6]]), "x": torch.randn(4, 2)}
    weight = torch.randn(2, 7, requires_grad=True)
    losses = []
    for micro in iter_microbatches(batch, 2):
        micro["labels"].masked_fill_(micro["labels"] == -100, 0)
        logits = (micro["x"] @ weight).unsqueeze(1).expand(-1, 2, -1)
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, 7), micro["labels"].reshape(-1)))
    for loss in losses:
        loss.backward()  # raised "modified by an inplace operation" when the slices shared one version counter
    assert batch["labels"].tolist() == [[1, 0], [2, 3], [0, 4], [5, 6]]


def test_the_last_stages_output_is_checked_for_stand_in_values_after_the_probe_ends():
    """The step runner checks the output after ``deactivate()`` (which ends the probe): it passes
    whether the forward was probed, else a stand-in's zeros in the output passed unnoticed."""
    from megastrategy.errors import MegatronConfigError
    from megastrategy.pipeline.stage import PipelineStage
    from megastrategy.pipeline.stand_in_values import mark

    stage = PipelineStage(stack_path="layers", chunks=[[0]], pp_rank=1, pp_size=2, vp_size=1)
    marked = {"encoder_last_hidden_state": mark(torch.zeros(2), ["model.encoder.final_layer_norm"])}
    stage.refuse_marked_output(marked)  # not probing: nothing checked
    with pytest.raises(MegatronConfigError, match="uses a value computed by model.encoder.final_layer_norm"):
        stage.refuse_marked_output(marked, probing=True)
