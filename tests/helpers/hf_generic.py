"""A tiny config for ANY Hugging Face architecture, from its config class defaults.

The hand-written configs of :mod:`tests.helpers.hf_zoo` cover the architectures the matrix was
built for; the sweep (tests/scripts/hf_sweep.py) needs every causal LM transformers ships, most of
which nobody wrote a tiny config for. So: start from the config class defaults (what a user gets)
and shrink every size attribute we know by name to the matrix's sizes (hidden 32, 2 layers, 4
heads, 2 key/value heads, head_dim 8, vocab 128, 4 experts top-2, dropouts 0). Lists with one
entry per layer (``layer_types``, block types) are cut to 2 entries, keeping two different kinds
where the default has them, so a hybrid stays hybrid. Sub-configs (``text_config`` ...) are shrunk
the same way. What the rules miss shows up as a failing one-process forward: the sweep skips those.
"""
from __future__ import annotations

from transformers import AutoConfig

VOCAB = 128
#: attribute name -> tiny value (set only where the config has the attribute)
_SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "model_dim", "embed_dim", "dim"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "encoder_ffn_dim",
                     "decoder_ffn_dim", "intermediate_size_mlp", "hidden_dim", "d_inner"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 16),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "mamba_num_heads", "linear_num_value_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "linear_num_key_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "d_kv", "attention_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "v_head_dim", "qk_nope_head_dim"), 8),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "rotary_dim"), 4),
    "mamba_head_dim": 16, "ssm_state_size": 8, "state_size": 8, "mamba_d_state": 8, "chunk_size": 8, "n_groups": 1,
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length",
                     "max_target_positions"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "top_k", "moe_topk"), 2),
    **dict.fromkeys(("n_shared_experts", "moe_num_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
    "layerdrop": 0.0, "use_mamba_kernels": False,
}
#: per-layer lists, cut to as many entries as layers
_PER_LAYER = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "mlp_layer_types")


def _two_kinds(values):
    """The first entry and the first entry unlike it (or the first twice): a hybrid stays hybrid."""
    other = next((v for v in values[1:] if v != values[0]), values[0])
    return values[0] + other if isinstance(values, str) else type(values)([values[0], other])


def _shrink(config) -> None:
    # per-layer lists first: setting the layer count may cut them to its first entries (all one kind)
    kinds = {name: _two_kinds(old) for name, old in vars(config).items()
             if name.lstrip("_") in _PER_LAYER and isinstance(old, (list, tuple, str)) and len(old) > 2}
    for name, value in _SIZES.items():
        old = getattr(config, name, None)
        if old is None or isinstance(old, bool) != isinstance(value, bool):
            continue
        if isinstance(old, (list, tuple)) and name.endswith("token_id"):
            value = [value]
        try:
            setattr(config, name, value)
        except (AttributeError, TypeError, ValueError):
            pass  # a read-only property (derived from what we set)
    for name, old in list(vars(config).items()):
        if ("dropout" in name or "pdrop" in name or name.endswith("drop_path_rate")) and isinstance(old, float):
            setattr(config, name, 0.0)
        elif name.endswith("_layer_period") and isinstance(old, int):
            setattr(config, name, 2)  # every other layer (Jamba's attention and experts)
        elif name.endswith("_layer_offset") and isinstance(old, int):
            setattr(config, name, min(old, 1))
        elif name == "sliding_window" and isinstance(old, int):
            setattr(config, name, 8)
        elif hasattr(old, "to_dict") and hasattr(old, "model_type"):
            _shrink(old)  # text_config, vision_config, ...
    for name, value in kinds.items():
        try:
            setattr(config, name.lstrip("_"), value)
        except (AttributeError, TypeError, ValueError):
            setattr(config, name, value)


def _latent_attention(config) -> None:
    """Multi-head latent attention (DeepSeek-style): rope on ``qk_rope_head_dim`` channels, one key per
    head (``head_dim`` is the rope width there, ``qk_head_dim`` their sum)."""
    if getattr(config, "qk_rope_head_dim", None) is None:
        return
    for name, value in (("head_dim", config.qk_rope_head_dim), ("num_key_value_heads", config.num_attention_heads),
                        ("qk_head_dim", config.qk_rope_head_dim + config.qk_nope_head_dim),
                        ("index_head_dim", 8), ("index_n_heads", 2)):
        if hasattr(config, name):
            setattr(config, name, value)


def generic_tiny_config(model_type: str):
    """The defaults of ``model_type``'s config class, shrunk (see the module docstring)."""
    config = AutoConfig.for_model(model_type)
    _shrink(config)
    _latent_attention(config)
    return config
