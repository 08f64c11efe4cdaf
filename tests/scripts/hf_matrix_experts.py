"""tests/scripts/hf_matrix.py with the expert sweep's configs: every generic tiny config of a
Hugging Face MoE model gets its router's auxiliary loss switched on (and weighted so a wrong one
shows), and experts where the defaults leave a model dense (DOTS1's ``n_routed_experts=None``,
HunYuan-MoE's ``num_experts=1``).

Why a wrapper and not an option of hf_matrix.py: the matrix is shared with the dense sweep, whose
configs must stay the config class defaults; here the point is the routed path and its aux loss,
which the defaults leave off (``output_router_logits=False`` everywhere).

    (launched by tests/scripts/hf_sweep_experts.py with hf_matrix.py's arguments)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers import hf_zoo  # noqa: E402
from tests.helpers.hf_generic import generic_tiny_config  # noqa: E402

#: expert counts and top-k the defaults may leave unset (None) or at 1 (a dense model)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_experts_per_token")
AUX_COEF = 0.1


def _configs(config):
    """``config`` and its sub-configs (``text_config`` ...)."""
    yield config
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            yield from _configs(value)


def expert_counts(config) -> dict:
    """Every expert-count field above 1 in ``config`` or its sub-configs (empty: a dense model)."""
    return {f"{c.model_type}.{k}": v for c in _configs(config) for k in _EXPERT_COUNTS
            if isinstance(v := getattr(c, k, None), int) and not isinstance(v, bool) and v > 1}


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
        if "output_router_logits" in vars(c):
            c.output_router_logits = True
        if isinstance(getattr(c, "router_aux_loss_coef", None), float):
            c.router_aux_loss_coef = AUX_COEF
    return config


def use_expert_configs() -> None:
    """Make :func:`tests.helpers.hf_zoo.tiny_config` build ``generic.*`` models from :func:`experts_tiny_config`."""
    hf_zoo.generic_tiny_config = experts_tiny_config


if __name__ == "__main__":
    use_expert_configs()
    from tests.scripts import hf_matrix
    from tests.helpers.script_args import leave_without_static_destructors

    hf_matrix.main()
    leave_without_static_destructors()
