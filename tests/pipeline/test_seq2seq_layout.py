"""The joined stack of an encoder-decoder: its two lists of blocks, and the modules placed before,
between and after them by two dry runs of the forward."""
import pytest
import torch
import transformers

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.seq2seq_layout import is_encoder_decoder, seq2seq_layout


class Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


def t5(num_layers=2, num_decoder_layers=3):
    config = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=num_layers,
                                   num_decoder_layers=num_decoder_layers, num_heads=2, d_kv=8)
    return Wrapper(transformers.T5ForConditionalGeneration(config))


def bart(config_cls=transformers.BartConfig):
    config = config_cls(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    return Wrapper(transformers.AutoModelForSeq2SeqLM.from_config(config))


def names(outside):
    return [o.name for o in outside]


def test_t5_joins_encoder_then_decoder_blocks_and_places_norms_and_embeddings_by_call():
    module = t5()
    layout = seq2seq_layout(module)
    assert (layout.encoder_path, layout.decoder_path) == ("model.encoder.block", "model.decoder.block")
    assert (layout.num_encoder, layout.num_decoder, layout.num_blocks) == (2, 3, 5)
    assert names(layout.pre) == ["model.shared", "model.encoder.embed_tokens"]  # shared: never called, registered first
    assert names(layout.between) == ["model.encoder.final_layer_norm", "model.decoder.embed_tokens"]
    assert names(layout.post) == ["model.decoder.final_layer_norm", "model.lm_head"]
    assert layout.encoder_carried == ((1, "position_bias"),)
    assert layout.decoder_carried == ((1, "position_bias"), (2, "encoder_decoder_position_bias"))
    assert layout.block(module, 1) is module.model.encoder.block[1]
    assert layout.block(module, 3) is module.model.decoder.block[1]


def test_bart_dry_runs_without_a_pad_token_and_mbart_puts_the_encoder_norm_between():
    layout = seq2seq_layout(bart())
    assert layout.encoder_path == "model.model.encoder.layers"
    assert names(layout.between) == ["model.model.decoder.embed_tokens", "model.model.decoder.embed_positions",
                                     "model.model.decoder.layernorm_embedding"]
    assert names(layout.post) == ["model.lm_head"]
    assert layout.encoder_carried == layout.decoder_carried == ()
    mbart = seq2seq_layout(bart(transformers.MBartConfig))
    assert names(mbart.between)[0] == "model.model.encoder.layer_norm"
    assert names(mbart.post) == ["model.model.decoder.layer_norm", "model.lm_head"]


def test_only_encoder_decoders_take_this_path():
    assert is_encoder_decoder(t5()) and is_encoder_decoder(bart())
    config = transformers.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8)
    assert not is_encoder_decoder(Wrapper(transformers.T5EncoderModel(config)))


def test_a_forward_the_dry_run_cannot_place_is_refused(monkeypatch):
    import megastrategy.pipeline.seq2seq_layout as layout_module

    monkeypatch.setattr(layout_module, "record_forward_order", lambda module, path: None)
    with pytest.raises(MegatronConfigError, match=r"pp>1 with the encoder-decoder T5ForConditionalGeneration.*Use pp=1"):
        seq2seq_layout(t5())
