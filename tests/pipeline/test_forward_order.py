"""The dry run finds where the forward calls each module, not where it is registered."""
import transformers
from torch import nn

from megastrategy.anatomy import ModelAnatomy, find_layer_stack
from megastrategy.pipeline.forward_order import record_forward_order
from tests.helpers.models import GPT

TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32)


class UserModule(nn.Module):
    """A LightningModule-like wrapper: the Hugging Face model is an attribute of the user's module."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.model = hf


def _order(hf: nn.Module):
    module = UserModule(hf)
    path, _ = find_layer_stack(module)
    return module, path, record_forward_order(module, path)


def test_a_decoder_whose_sdpa_mask_reads_values_is_dry_run_with_eager_attention():
    """BartForCausalLM's decoder builds a padding mask that SDPA's shortcut reads (``.all()``): no
    value on meta. The retry with eager attention sees layernorm_embedding run before the layers."""
    from tests.helpers.hf_zoo import tiny_model

    module, path, order = _order(tiny_model("generic.bart"))
    assert path == "model.model.decoder.layers" and order is not None
    assert order.called["model.model.decoder.layernorm_embedding"] == {"before"}
    assert module.model.config._attn_implementation == "sdpa"  # the user's model is untouched


def test_opt_final_layer_norm_registered_before_the_layers_runs_after_them():
    module, path, order = _order(transformers.OPTForCausalLM(transformers.OPTConfig(**TINY, ffn_dim=32, word_embed_proj_dim=16)))
    assert path == "model.model.decoder.layers"
    assert order.called["model.model.decoder.final_layer_norm"] == {"after"}
    assert order.called["model.model.decoder.embed_tokens"] == {"before"}
    assert order.stack_calls == (0, 1, 2, 3) and not order.reuses_blocks
    by_registration = ModelAnatomy.of(module, path)
    assert "model.model.decoder.final_layer_norm" in {o.name for o in by_registration.pre}  # the old placement
    by_forward = ModelAnatomy.of(module, path, order.called)
    assert {o.name for o in by_forward.post} == {"model.model.decoder.final_layer_norm", "model.lm_head"}
    assert {o.name for o in by_forward.pre} == {"model.model.decoder.embed_tokens", "model.model.decoder.embed_positions"}
    assert len(by_forward.tied_parameters) == 1  # lm_head shares embed_tokens' weight


def test_xlm_roberta_classifier_runs_after_the_encoder():
    config = transformers.XLMRobertaConfig(**TINY, num_labels=3)
    module, path, order = _order(transformers.XLMRobertaForSequenceClassification(config))
    anatomy = ModelAnatomy.of(module, path, order.called)
    assert [o.name for o in anatomy.post] == ["model.classifier"]
    assert [o.name for o in anatomy.pre] == ["model.roberta.embeddings"]


def test_albert_applies_its_one_shared_block_once_per_layer():
    config = transformers.AlbertConfig(**TINY, embedding_size=8)
    module, path, order = _order(transformers.AlbertForSequenceClassification(config))
    assert path == "model.albert.encoder.albert_layer_groups"
    assert order.stack_calls == (0, 0, 0, 0) and order.reuses_blocks
    anatomy = ModelAnatomy.of(module, path, order.called)
    assert "model.albert.encoder.embedding_hidden_mapping_in" in {o.name for o in anatomy.pre}


def test_dry_run_leaves_the_model_and_the_random_state_alone():
    import torch

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, num_key_value_heads=1, pad_token_id=0))
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    state = torch.random.get_rng_state()
    assert _order(hf)[2] is not None
    assert torch.equal(state, torch.random.get_rng_state()) and hf.config.pad_token_id == 0
    assert all(torch.equal(before[k], v) and v.device.type == "cpu" for k, v in hf.state_dict().items())


def test_a_model_without_hugging_face_keeps_registration_order():
    module = GPT(n_layer=4)
    path, _ = find_layer_stack(module)
    assert record_forward_order(module, path) is None


def test_the_dry_run_sees_every_architecture_of_the_pipeline_matrix():
    from megastrategy.pipeline.direct_forward import route_direct_forward_calls
    from tests.scripts.train_hf_stages import ARCHITECTURES, HFModule

    for name in ARCHITECTURES:
        module = HFModule(name)
        path, stack = find_layer_stack(module)
        route_direct_forward_calls(stack)  # as the pipeline component does first (SqueezeBERT calls layer.forward)
        order = record_forward_order(module, path)
        assert order is not None and order.carried == (((1, "position_bias"),) if name == "t5-encoder" else ()), name
        assert len(order.stack_calls) == 4, (name, order.stack_calls)


def test_a_vision_model_runs_on_random_pixels_and_swins_loop_state_refuses_a_cut():
    """ViT's dummy inputs have no pixel_values: the dry run makes them. Swin's loop halves
    ``input_dimensions`` after each downsampling stage, so no pipeline stage may start at stage 1;
    a plain argument that stays the same (ViT has none that changes) refuses nothing."""
    from megastrategy.pipeline.forward_order import loop_state_refusal
    from tests.helpers.hf_zoo import tiny_model

    _, vit_path, vit = _order(tiny_model("vit", task="img"))
    assert vit.stack_calls == (0, 1) and vit.loop_state == ()
    assert vit.called["model.vit.embeddings"] == {"before"} and vit.called["model.classifier"] == {"after"}
    _, path, swin = _order(tiny_model("swin", task="img"))
    assert swin.loop_state == ((1, "input_dimensions", (4, 4), (8, 8)),)
    assert "block 1 of model.swin.encoder.layers" in loop_state_refusal(swin, path, [[[0]], [[1]]])
    assert loop_state_refusal(swin, path, [[[0, 1]]]) is None and loop_state_refusal(vit, vit_path, [[[0]], [[1]]]) is None
