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
    AutoModelForAudioClassification,
    AutoModelForCTC,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForSpeechSeq2Seq,
    AutoModelForTokenClassification,
)

from tests.helpers.hf_generic import VOCAB, generic_tiny_config
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


#: decoders with their own config names (no shared base): hidden 32, 2 layers, 4 heads
_OWN_DECODER_CONFIGS = {
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, rotary_dim=4, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "codegen": dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, rotary_dim=4, n_positions=64, n_ctx=64,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64, multi_query=True, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0),
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, resid_pdrop=0.0, emb_pdrop=0.0,
                attn_config=dict(alibi=False, attn_pdrop=0), norm_type="layernorm"),
}
#: vision and audio models (their own inputs: pixel_values, input_values, input_features)
_OWN_CONFIGS = {
    "vit": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                patch_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "swin": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=2, image_size=16, patch_size=2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
    "convnext": dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=16, patch_size=2,
                     drop_path_rate=0.0),
    "wav2vec2": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                     num_conv_pos_embedding_groups=4, classifier_proj_size=16, mask_time_prob=0.0, ctc_loss_reduction="mean",
                     mask_feature_prob=0.0, layerdrop=0.0, hidden_dropout=0.0, activation_dropout=0.0,
                     attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0),
    "whisper": dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                    max_source_positions=16, max_target_positions=64, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                    suppress_tokens=[], begin_suppress_tokens=[]),
}
# DeiT maps to two image classifiers: transformers picks by ``architectures`` (None fails)
_OWN_CONFIGS["deit"] = dict(_OWN_CONFIGS["vit"], architectures=["DeiTForImageClassification"])
#: one architecture, another setting: name -> (architecture, overrides)
_VARIANTS = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    # packed q|k|v with every head its own key/value head ([heads, q|k|v, head_dim]), beside the default multi-query
    "gpt_bigcode-mha": ("gpt_bigcode", dict(multi_query=False)),
    # Falcon-7B's layout (the config's defaults): multi-query [4 query heads + key + value, head_dim]
    "falcon-mqa": ("falcon", dict(new_decoder_architecture=False, multi_query=True, num_attention_heads=4,
                                  num_kv_heads=None)),
    # multi-query with separate projections and a declared plan (Gemma-2B: one key/value head)
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "gemma-mqa": ("gemma", dict(num_key_value_heads=1)),
}
#: encoders used for token-level tasks (tok, qa, mc) with the encoder base
TASK_ENCODERS = ("bert",)
#: task -> the Auto class beyond lm/cls (tests/scripts/hf_matrix.py builds their batches)
TASK_AUTO = {"tok": AutoModelForTokenClassification, "qa": AutoModelForQuestionAnswering,
             "mc": AutoModelForMultipleChoice, "img": AutoModelForImageClassification,
             "audio": AutoModelForAudioClassification, "ctc": AutoModelForCTC}
_DECODER_EXTRA = {
    "gemma3_text": dict(sliding_window=4, query_pre_attn_scalar=8),
    "qwen2_moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2),
    # 2025-2026 architectures (tests/layers/test_hf_matrix.py NEW_*): MoE ones with 4 experts, top-2
    "deepseek_v3": dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                        num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": dict(intermediate_size=16, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layer_interval=2),
    "qwen3_next": dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                             linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_text": dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                         linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"]),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=8, expand=2),
    "jamba": dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                  attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8),
    "nemotron_h": dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=8, n_groups=1, chunk_size=8, use_mamba_kernels=False),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False),
    "glm4_moe": dict(moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                     first_k_dense_replace=1),
    "ernie4_5_moe": dict(moe_intermediate_size=16, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                         moe_layer_start_index=1),
}


#: prefix of an architecture name that asks for :func:`generic_tiny_config` (the sweep's configs)
GENERIC = "generic."


def tiny_config(arch: str, **overrides):
    if arch.startswith(GENERIC):
        config = generic_tiny_config(arch[len(GENERIC):])
        config.update(overrides)
        return config
    if arch in _VARIANTS:
        arch, extra = _VARIANTS[arch]
        overrides = {**extra, **overrides}
    if arch in _OWN_DECODER_CONFIGS or arch in _OWN_CONFIGS:
        own = _OWN_DECODER_CONFIGS.get(arch) or _OWN_CONFIGS[arch]
        common = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=VOCAB, tie_word_embeddings=False)
        base = common if arch in _OWN_DECODER_CONFIGS else {}
        return AutoConfig.for_model(arch, **{**base, **own, **overrides})
    base = _ENCODER if arch in ENCODERS + TASK_ENCODERS else _SEQ2SEQ.get(arch, _DECODER)
    base = {**base, **_DECODER_EXTRA.get(arch, {})}
    if arch == "falcon":  # head_dim is a read-only property of FalconConfig
        base = {k: v for k, v in base.items() if k != "head_dim"}
    return AutoConfig.for_model(arch, **{**base, **_EXTRA.get(arch, {}), **overrides})


def tiny_model(arch: str, task: str = "lm", seed: int = 0, **overrides):
    """``task``: ``lm`` (causal LM for decoders, masked LM for encoders, seq2seq LM for
    encoder-decoders and Whisper), ``cls`` (3 labels) or a task of ``TASK_AUTO``."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if task == "cls" or task in TASK_AUTO:
            config.num_labels = 2 if task == "qa" else 3  # QA: a start and an end logit per token
            return (TASK_AUTO.get(task) or AutoModelForSequenceClassification).from_config(config)
        auto = AutoModelForMaskedLM if arch in ENCODERS else AutoModelForCausalLM
        auto = AutoModelForSeq2SeqLM if arch in ENCODER_DECODERS else auto
        auto = AutoModelForSpeechSeq2Seq if arch == "whisper" else auto
        return auto.from_config(config)
