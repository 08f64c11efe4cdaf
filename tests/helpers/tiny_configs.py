"""A tiny configuration for ANY Hugging Face architecture, from its config class's defaults.

Why: the hand-written zoo (tests/helpers/hf_zoo.py) covers the architectures someone chose; a sweep
over every architecture of a task mapping needs configs nobody wrote. Every size attribute a config
class is known to use is shrunk (hidden 32, feed-forward 64, 2 layers, 4 heads of 8, vocab 128, image
16 with patch 4, per-stage lists cut to 2 stages) and every dropout is set to 0 so that one device and
two devices draw no random numbers that could differ. Sub-configs (``text_config``, ``vision_config``,
...) are shrunk the same way. A config the class then refuses is the caller's to skip.
"""
from __future__ import annotations

import transformers
from transformers import CONFIG_MAPPING, PretrainedConfig

VOCAB = 128
#: attribute name -> value, applied where the class's defaults have the attribute
_SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "word_embed_proj_dim"), 32),
    **dict.fromkeys(("intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "ffn_dim", "n_inner",
                     "hidden_dim", "decoder_intermediate_size", "mlp_dim", "d_inner"), 64),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers", "n_layers", "n_layer",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads", "n_heads",
                     "n_head", "num_key_value_heads", "encoder_num_attention_heads"), 4),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_size", "d_head"), 8),
    **dict.fromkeys(("embedding_size", "embed_dim", "emb_dim", "projection_dim", "projection_size", "classifier_proj_size"), 32),
    **dict.fromkeys(("entity_vocab_size", "pronunciation_vocab_size", "shape_vocab_size"), 16),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts"), 4), "moe_intermediate_size": 16,
    "entity_emb_size": 32, "d_latents": 32, "num_latents": 16, "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "max_seq_len": 64,
    "image_size": 16, "patch_size": 4, "num_channels": 3,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
}
#: per-stage lists (hierarchical vision models): name -> the value for stage i
_STAGES = {"depths": lambda i: 1, "hidden_sizes": lambda i: 16 * 2 ** i, "embed_dims": lambda i: 16 * 2 ** i,
           "num_heads": lambda i: 2 * 2 ** i, "window_size": None}
_STAGE_COUNT = 2


def _is_dropout(name: str, value) -> bool:
    return isinstance(value, float) and ("dropout" in name or "drop" in name.split("_") or name == "layerdrop"
                                         or name.endswith("_pdrop") or name.startswith("drop_"))


def _stage_lists(defaults: dict) -> dict:
    """Per-stage lists cut to ``_STAGE_COUNT`` stages: the length of ``depths`` tells which lists are per stage."""
    stages = len(defaults["depths"]) if isinstance(defaults.get("depths"), (list, tuple)) else None
    out = {}
    for name, value in defaults.items():
        if not isinstance(value, (list, tuple)) or stages is None or len(value) != stages:
            continue
        make = _STAGES.get(name)
        out[name] = [make(i) for i in range(_STAGE_COUNT)] if make else list(value[:_STAGE_COUNT])
    for name in ("num_stages", "num_encoder_blocks"):
        if stages is not None and name in defaults:
            out[name] = _STAGE_COUNT
    return out


def shrunk_kwargs(defaults: dict) -> dict:
    """The overrides for one config's defaults (its ``to_dict()``)."""
    out = {k: v for k, v in _SIZES.items() if k in defaults and not isinstance(defaults[k], (list, dict))}
    out.update({k: 0.0 for k, v in defaults.items() if _is_dropout(k, v)})
    if isinstance(defaults.get("block_sizes"), (list, tuple)):  # Funnel: blocks of layers
        out["block_sizes"] = [1] * len(defaults["block_sizes"])
    if isinstance(defaults.get("layer_types"), (list, tuple)):  # one entry per layer, 2 layers
        out["layer_types"] = list(defaults["layer_types"][:2])
    if isinstance(defaults.get("window_size"), int):
        out["window_size"] = 2
    out.update(_stage_lists(defaults))
    return out


def tiny_config(model_type: str) -> PretrainedConfig:
    """The config class of ``model_type`` built with shrunk sizes; sub-configs shrunk likewise."""
    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    kwargs = shrunk_kwargs(defaults)
    for name, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value and value.get("model_type") in CONFIG_MAPPING:
            sub = value["model_type"]
            kwargs[name] = {**value, **shrunk_kwargs(value), "model_type": sub}
    return cls(**kwargs)


def model_class(class_name):
    """The model class a task mapping names; a tuple (several heads, e.g. DeiT with teacher) -> the first."""
    name = class_name[0] if isinstance(class_name, (tuple, list)) else class_name
    return getattr(transformers, name)
