"""Setup refuses what the first step's stand-in checks would refuse (a value computed before the
stack read past the cut; a module before the stack that needs values on the meta device), so the
user loses no launch; what the step would accept passes."""
from types import SimpleNamespace

import pytest
from torch import nn

from megastrategy.anatomy import ModelAnatomy
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.component import Pipeline
from megastrategy.pipeline.forward_order import record_forward_order
from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.stand_in_probe import refuse_stand_in_values
from tests.pipeline.test_stand_in_values import _Model  # embedding, 4 blocks, head; the embedding's side use


class _ValueReadingEmbedding(nn.Embedding):
    """Checks its ids' values, as I-BERT's quantized embeddings read a scale: no value on meta."""

    def forward(self, ids):
        if ids.max().item() >= self.num_embeddings:
            raise ValueError("id out of range")
        return super().forward(ids)


class _TokenModel(_Model):
    """test_stand_in_values's model as a token-id model (``config.vocab_size``: the dry run runs it)."""

    def __init__(self, side: str = "none", embedding: type = nn.Embedding):
        super().__init__(side)
        self.config = SimpleNamespace(vocab_size=10)
        self.embed = embedding(10, 4)


def _probe(model: nn.Module, pp: int = 2) -> None:
    order = record_forward_order(model, "blocks")
    anatomy = ModelAnatomy.of(model, "blocks", order.called if order is not None else None)
    refuse_stand_in_values(model, anatomy, order, assign_layers(4, pp), None)


def test_a_value_reaching_only_the_first_block_or_shapes_passes():
    _probe(_TokenModel("none"))
    _probe(_TokenModel("none"), pp=4)


@pytest.mark.parametrize("side, where", [("block", r"blocks\.2 \(on its inputs\)"), ("head", r"head \(on its inputs\)")])
def test_a_value_computed_before_the_stack_read_past_the_cut_is_refused_in_setup(side, where):
    with pytest.raises(MegatronConfigError, match=where + r" uses a value computed by embed .*pp=1"):
        _probe(_TokenModel(side))
    with pytest.raises(MegatronConfigError, match=where):  # through the component's validate, before any step
        Pipeline(MegatronConfig(pp=2)).validate(_TokenModel(side), None)


def test_a_module_before_the_stack_that_reads_values_is_refused_in_setup():
    with pytest.raises(MegatronConfigError, match=r"embed \(_ValueReadingEmbedding\) runs before the pipeline layer stack"):
        _probe(_TokenModel(embedding=_ValueReadingEmbedding))


def test_hugging_face_models_whose_layers_read_a_pre_stack_value_are_refused_in_setup():
    """RoFormer's sinusoidal positions and CPM-Ant's position bias feed every layer. RoFormer's dry
    run (its mask asks whether the padding mask is all ones, on meta) now runs, so it is seen."""
    from tests.helpers.hf_zoo import tiny_model

    for arch, source in (("generic.roformer", "encoder.embed_positions"), ("generic.cpmant", "position_bias")):
        module = nn.Module()
        module.model = tiny_model(arch)
        with pytest.raises(MegatronConfigError, match=rf"layers?\.1 \(on its inputs\) uses a value computed by .*{source}"):
            Pipeline(MegatronConfig(pp=2)).validate(module, None)


def test_with_virtual_stages_the_refusal_names_the_stage_and_the_rank_holding_it():
    model = _TokenModel("block")  # blocks.2 reads the embedding's value
    order = record_forward_order(model, "blocks")
    anatomy = ModelAnatomy.of(model, "blocks", order.called if order is not None else None)
    with pytest.raises(MegatronConfigError, match=r"blocks\.1 \(on its inputs\) uses a value computed by embed on "
                                                  r"virtual pipeline stage 1 \(a chunk of pipeline rank 1\)"):
        refuse_stand_in_values(model, anatomy, order, assign_layers(4, 2, 2), None)
    with pytest.raises(MegatronConfigError, match=r"computed by embed on pipeline stage 1,"):
        _probe(_TokenModel("block"))
