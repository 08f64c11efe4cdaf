"""ALBERT's one shared block, pipelined by its applications: each stage runs its share of them with
its own copy, starting from the previous stage's activation, and the copies are tied."""
import copy

import pytest
import torch
import transformers

from megastrategy.anatomy import ModelAnatomy
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.forward_order import record_forward_order
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.stage import StageBoundary, cut_stage

PATH = "albert.encoder.albert_layer_groups"


def _albert(layers: int = 4) -> transformers.AlbertForSequenceClassification:
    torch.manual_seed(0)
    config = transformers.AlbertConfig(vocab_size=64, hidden_size=16, embedding_size=8, num_hidden_layers=layers,
                                       num_attention_heads=2, intermediate_size=32, num_labels=3,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    return transformers.AlbertForSequenceClassification(config).eval()


def _stage(model, pp_rank: int, pp_size: int = 2, vp_size: int = 1):
    order = record_forward_order(model, PATH)
    anatomy = ModelAnatomy.of(model, PATH, order.called)
    return cut_stage(model, stack_path=PATH, stack=anatomy.stack, assignment=assign_layers(4, pp_size, vp_size),
                     pp_rank=pp_rank, pp_size=pp_size, vp_size=vp_size, anatomy=anatomy, stack_calls=order.stack_calls)


def test_each_stage_applies_the_shared_block_for_its_share_and_matches_one_device():
    full, ids = _albert(), torch.randint(3, 64, (2, 6))
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    first_stage, last_stage = _stage(first, 0), _stage(last, 1)
    hidden = []
    full.albert.encoder.albert_layer_groups[0].register_forward_hook(lambda m, a, out: hidden.append(out.detach()))
    expected = full(input_ids=ids).logits

    first_stage.activate(0, None)
    with pytest.raises(StageBoundary) as boundary:
        first(input_ids=ids)
    first_stage.deactivate()
    assert torch.allclose(boundary.value.output, hidden[1], atol=1e-6)  # after application 2 of 4

    ran = []
    last.albert.encoder.albert_layer_groups._modules["0"].register_forward_hook(lambda m, a, out: ran.append(out))
    last_stage.activate(0, boundary.value.output)
    got = last(input_ids=ids).logits
    last_stage.deactivate()
    assert torch.allclose(got, expected, atol=1e-6)
    assert len(ran) == 2  # the real block ran for applications 3 and 4 only
    shared = last_stage.shared_layer_parameters
    assert shared and {id(p) for p in shared} <= {id(p) for p in last_stage.tied_parameters}
    assert {id(p) for p in shared} <= {id(p) for p in last.parameters()}  # every stage keeps its copy


def test_a_forward_that_applies_other_blocks_than_the_dry_run_is_an_error():
    model = _albert()
    stage = _stage(model, 1)
    model.config.num_hidden_layers = 5  # one application more than the dry run saw
    stage.activate(0, torch.zeros(2, 6, 16))
    with pytest.raises(MegatronConfigError, match="dry run of the forward applied blocks"):
        model(input_ids=torch.randint(3, 64, (2, 6)))
    stage.deactivate()
