"""tests/scripts/hf_matrix.py with the expert sweep's configs: every generic tiny config of a
Hugging Face MoE model gets its router's auxiliary loss switched on (and weighted so a wrong one
shows), experts where the defaults leave a model dense (DOTS1's ``n_routed_experts=None``,
HunYuan-MoE's ``num_experts=1``), routed layers where the defaults keep the first ones dense
(DeepSeek-V3's ``first_k_dense_replace=3`` of two layers), and the few sizes the generic rules miss
(DBRX's attention sub-config, GraniteMoE-Hybrid's Mamba heads).

Why a wrapper and not an option of hf_matrix.py: the matrix is shared with the dense sweep, whose
configs must stay the config class defaults; here the point is the routed path and its aux loss,
which the defaults leave off (``output_router_logits=False`` everywhere).

    (launched by tests/scripts/hf_sweep_experts.py with hf_matrix.py's arguments, and
    ``--microbatches N`` for MegatronStrategy's num_microbatches)
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from megastrategy.moe.unsplit_experts import EXPERT_COUNT_FIELDS as _EXPERT_COUNTS  # noqa: E402
from tests.helpers import hf_zoo  # noqa: E402
from tests.helpers.hf_generic import generic_tiny_config  # noqa: E402

#: top-k fields the defaults may leave unset (None); the expert counts, unset or at 1 (a dense model), are _EXPERT_COUNTS
_TOP_K = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_experts_per_token")
AUX_COEF = 0.1
#: fields that keep the first layers dense: capped at 1, so that layer 1 of the two is routed
_DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
#: sizes some config classes leave None by default (then their model cannot be built)
_UNSET = {"n_shared_experts": 1, "head_dim": 8}


def _configs(config):
    """``config`` and its sub-configs (``text_config`` ...)."""
    yield config
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            yield from _configs(value)


def expert_counts(config) -> dict:
    """Every expert-count field above 1 in ``config`` or its sub-configs (empty: a dense model)."""
    return {f"{c.model_type}.{k}": v for c in _configs(config) for k in _EXPERT_COUNTS
            if isinstance(v := _read(c, k), int) and not isinstance(v, bool) and v > 1}


def _read(config, name: str):
    """``config.name``, or None where reading it raises (a per-layer attribute of a heterogeneous config)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return None


def experts_tiny_config(model_type: str):
    """The generic tiny config, routed (4 experts top-2 where unset or 1) with its aux loss on."""
    config = generic_tiny_config(model_type)
    for c in _configs(config):
        for k in _EXPERT_COUNTS:
            if k in vars(c) and (getattr(c, k) is None or getattr(c, k) == 1):
                setattr(c, k, 4)
        for k in _TOP_K:
            if k in vars(c) and getattr(c, k) is None:
                setattr(c, k, 2)
        _route_every_layer(c)
        if "output_router_logits" in vars(c):
            c.output_router_logits = True
        if isinstance(getattr(c, "router_aux_loss_coef", None), float):
            c.router_aux_loss_coef = AUX_COEF
    return config


def _route_every_layer(c) -> None:
    """Routed layers among the two (the defaults of DeepSeek-V3, Flint, LFM2-MoE make both dense),
    the sizes left unset filled in, and no KV cache in training (a hybrid whose first layer is not
    attention cannot report its cache's length)."""
    for k in _DENSE_FIRST:
        if isinstance(getattr(c, k, None), int) and getattr(c, k) > 1:
            setattr(c, k, 1)
    if isinstance(getattr(c, "mlp_only_layers", None), list):
        c.mlp_only_layers = []
    for k, v in _UNSET.items():
        if k in vars(c) and getattr(c, k) is None:
            setattr(c, k, v)
    if c.model_type == "lfm2_moe" and c.layer_types is None:
        c.layer_types = ["conv", "full_attention"]
    if c.model_type == "dbrx":  # its attention sub-config has no model_type: not shrunk by the generic rules
        c.attn_config.rope_theta = getattr(c.attn_config, "rope_theta", None) or 10000.0
        c.attn_config.clip_qkv = c.attn_config.clip_qkv or 8.0
    if getattr(c, "mamba_n_heads", None) and getattr(c, "mamba_d_head", None):  # GraniteMoE-Hybrid's Mamba
        c.mamba_n_heads, c.mamba_d_head, c.mamba_chunk_size = 4, c.mamba_expand * c.hidden_size // 4, 8
    if "use_cache" in vars(c):
        c.use_cache = False


def pop_microbatches(argv: list[str]) -> None:
    """Take ``--microbatches N`` out of ``argv`` (hf_matrix.py has no such option) and make every
    ``MegatronStrategy`` the matrix builds use ``num_microbatches=N`` (pp with the router's aux loss
    needs one: the loss is a batch-wide statistic)."""
    if "--microbatches" not in argv:
        return
    i = argv.index("--microbatches")
    count = int(argv[i + 1])
    del argv[i:i + 2]
    import megastrategy

    megastrategy.MegatronStrategy = functools.partial(megastrategy.MegatronStrategy, num_microbatches=count)


def use_expert_configs() -> None:
    """Make :func:`tests.helpers.hf_zoo.tiny_config` build ``generic.*`` models from :func:`experts_tiny_config`."""
    hf_zoo.generic_tiny_config = experts_tiny_config


if __name__ == "__main__":
    use_expert_configs()
    pop_microbatches(sys.argv)
    from tests.scripts import hf_matrix
    from tests.helpers.script_args import leave_without_static_destructors

    hf_matrix.main()
    leave_without_static_destructors()
