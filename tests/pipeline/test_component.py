"""The pipeline component refuses, before any collective, what its schedule cannot honour."""
import pytest

from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.component import Pipeline
from tests.helpers.models import GPT


def test_manual_optimization_under_pp_is_refused_naming_the_fix():
    module = GPT(n_layer=4)
    module.automatic_optimization = False
    with pytest.raises(MegatronConfigError, match=r"automatic_optimization=False with pp=2.*pp=1"):
        Pipeline(MegatronConfig(pp=2)).validate(module, None)


def test_automatic_optimization_with_enough_layers_passes():
    Pipeline(MegatronConfig(pp=2)).validate(GPT(n_layer=4), None)
    with pytest.raises(MegatronConfigError, match="layers"):
        Pipeline(MegatronConfig(pp=4)).validate(GPT(n_layer=2), None)


def test_encoder_decoder_under_pp_joins_its_two_stacks_and_refuses_what_it_does_not_run():
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8)
    module = transformers.T5ForConditionalGeneration(config)
    Pipeline(MegatronConfig(pp=2)).validate(module, None)  # 2 encoder + 2 decoder blocks over 2 stages
    Pipeline(MegatronConfig(pp=3)).validate(module, None)  # 2 + 1 + 1: stage 1 starts at the seam
    with pytest.raises(MegatronConfigError, match="num_layers=4 cannot fill pp_size=5"):
        Pipeline(MegatronConfig(pp=5)).validate(module, None)
    Pipeline(MegatronConfig(pp=2, pipeline_schedule="zb_h1")).validate(module, None)
    with pytest.raises(MegatronConfigError, match=r"pipeline_layers='model.decoder.block' with an encoder-decoder"):
        Pipeline(MegatronConfig(pp=2, pipeline_layers="model.decoder.block")).validate(module, None)


def test_layer_drop_under_pp_is_refused_naming_the_setting():
    import transformers

    config = transformers.M2M100Config(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
                                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                       decoder_ffn_dim=32, max_position_embeddings=32)
    assert config.encoder_layerdrop > 0  # M2M100's (and NLLB's) default
    module = transformers.M2M100ForConditionalGeneration(config)
    with pytest.raises(MegatronConfigError, match=r"config.encoder_layerdrop=0.05: layer drop skips blocks.*or use pp=1"):
        Pipeline(MegatronConfig(pp=2)).validate(module, None)
    config.encoder_layerdrop = config.decoder_layerdrop = 0.0
    Pipeline(MegatronConfig(pp=2)).validate(transformers.M2M100ForConditionalGeneration(config), None)


def test_albert_is_split_by_applications_of_its_shared_block():
    import transformers

    config = transformers.AlbertConfig(vocab_size=64, hidden_size=16, embedding_size=8, num_hidden_layers=4,
                                       num_attention_heads=2, intermediate_size=32)
    module = transformers.AlbertForSequenceClassification(config)
    assert len(module.albert.encoder.albert_layer_groups) == 1
    Pipeline(MegatronConfig(pp=4)).validate(module, None)  # 4 applications over 4 stages
    Pipeline(MegatronConfig(pp=3)).validate(module, None)  # 2 + 1 + 1 applications
    with pytest.raises(MegatronConfigError, match="num_layers=4 cannot fill pp_size=5"):
        Pipeline(MegatronConfig(pp=5)).validate(module, None)



def test_router_load_balancing_loss_under_pp_needs_the_whole_batch_as_one_microbatch():
    """Its logits are carried to the last stage (tests/pipeline/test_router_logits.py), but the loss is
    a batch-wide statistic: per microbatch it would differ from one device's."""
    import transformers

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        output_router_logits=True)
    module = transformers.MixtralForCausalLM(config)
    with pytest.raises(MegatronConfigError, match=r"num_microbatches=2.*output_router_logits=True.*Pass num_microbatches=1"):
        Pipeline(MegatronConfig(pp=2)).validate(module, None)
    Pipeline(MegatronConfig(pp=2, num_microbatches=1)).validate(module, None)
    module.config.output_router_logits = False
    Pipeline(MegatronConfig(pp=2)).validate(module, None)
