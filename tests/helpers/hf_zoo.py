"""Tiny Hugging Face models of many architectures, built from configs (no weights downloaded).

Every model has hidden 32, 2 layers, 4 attention heads (2 key/value heads where the
architecture has GQA), vocab 128: small enough to train a few steps of each on two CPU processes.
"""
from __future__ import annotations

import warnings

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64, tie_word_embeddings=False)
_DECODER = dict(_COMMON, num_key_value_heads=2, head_dim=8)
_ENCODER = dict(_COMMON, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=True)

#: decoders whose config declares ``base_model_tp_plan`` (causal LM, loss from ``labels=``)
DECLARED_DECODERS = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "phi", "olmo", "olmo2", "granite",
    "cohere", "gpt_neox", "starcoder2", "glm", "glm4", "smollm3", "helium", "arcee", "exaone4", "seed_oss",
    "nemotron",
)
#: decoders that declare no plan, sharded by the built-in Llama-family rules
BUILTIN_DECODERS = ("stablelm",)
#: decoders with neither: sharded by structural detection (traced data flow). Falcon in its
#: grouped-query layout (packed [kv groups, q per group + k + v, head_dim]); Persimmon with its
#: packed per-head [heads, q|k|v, head_dim] projection and per-head q/k LayerNorms
STRUCTURAL_DECODERS = ("falcon", "persimmon")
#: encoder-decoders (``AutoModelForSeq2SeqLM``, labels = the input ids): hidden 32, 2+2 layers, 4 heads
ENCODER_DECODERS = ("bart", "t5")
_SEQ2SEQ = {
    "bart": dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
                 activation_dropout=0.0, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 decoder_start_token_id=2),
    "t5": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               dropout_rate=0.0, relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0,
               eos_token_id=2, decoder_start_token_id=0),
}
#: a declared plan the strategy refuses in setup: transformers' Apertus plan shards the MLP around
#: xIELU, whose learnable alpha_p/alpha_n would get partial gradients
REFUSED_DECLARED = ("apertus",)
#: encoders with a built-in plan (masked LM, and one sequence classifier)
ENCODERS = ("roberta", "xlm-roberta", "camembert", "electra", "distilbert", "albert", "deberta-v2", "modernbert")
_EXTRA = {
    "distilbert": dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4, dropout=0.0, attention_dropout=0.0),
    "albert": dict(embedding_size=16, classifier_dropout_prob=0.0),
    "electra": dict(embedding_size=32),
    "deberta-v2": dict(relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=False, position_buckets=8,
                       max_relative_positions=16, position_biased_input=False),
    "modernbert": dict(global_attn_every_n_layers=2, local_attention=8, embedding_dropout=0.0, mlp_dropout=0.0,
                       attention_dropout=0.0),
    "gpt_neox": dict(use_parallel_residual=True, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0),
    "phi": dict(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0),
    "seed_oss": dict(residual_dropout=0.0, attention_dropout=0.0),
    "falcon": dict(new_decoder_architecture=True, num_attention_heads=8, num_kv_heads=2, alibi=False,
                   hidden_dropout=0.0, attention_dropout=0.0),
    "persimmon": dict(qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0),
}


def tiny_config(arch: str, **overrides):
    base = _ENCODER if arch in ENCODERS else _SEQ2SEQ.get(arch, _DECODER)
    if arch == "falcon":  # head_dim is a read-only property of FalconConfig
        base = {k: v for k, v in base.items() if k != "head_dim"}
    return AutoConfig.for_model(arch, **{**base, **_EXTRA.get(arch, {}), **overrides})


def tiny_model(arch: str, task: str = "lm", seed: int = 0, **overrides):
    """``task``: ``lm`` (causal LM for decoders, masked LM for encoders, seq2seq LM for
    encoder-decoders) or ``cls`` (3 labels)."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if task == "cls":
            config.num_labels = 3
            return AutoModelForSequenceClassification.from_config(config)
        auto = AutoModelForMaskedLM if arch in ENCODERS else AutoModelForCausalLM
        auto = AutoModelForSeq2SeqLM if arch in ENCODER_DECODERS else auto
        return auto.from_config(config)
