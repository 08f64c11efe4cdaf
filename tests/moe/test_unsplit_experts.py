"""ep > 1 on a Hugging Face model whose experts expert parallelism cannot split is refused in setup
(src/megastrategy/moe/unsplit_experts.py), instead of training with every expert whole on every rank."""
from __future__ import annotations

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.moe.integration import validate_moe
from megastrategy.moe.unsplit_experts import declared_experts
from megastrategy.parallel_state import ParallelLayout

transformers = pytest.importorskip("transformers")
EP2 = ParallelLayout(world_size=2, ep=2)


def _dbrx():
    """DBRX keeps its experts flattened into 2-D w1/v1/w2 [experts * ffn, hidden]."""
    cfg = transformers.DbrxConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=64, max_seq_len=32,
                                  attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                  ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2})
    return transformers.DbrxForCausalLM(cfg)


def test_experts_in_a_layout_not_split_are_refused_naming_the_module_and_the_fix():
    with pytest.raises(MegatronConfigError, match=r"ep=2: DbrxForCausalLM's config declares 4 experts "
                                                  r"\(config.ffn_config.moe_num_experts\).*'transformer.blocks.0.ffn."
                                                  r"experts' \(DbrxExperts\).*Use ep=1"):
        validate_moe(_dbrx(), EP2)


def test_at_ep1_or_without_declared_experts_nothing_is_refused():
    validate_moe(_dbrx(), ParallelLayout(world_size=2))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    validate_moe(llama, EP2)  # no experts at all: the expert grid is simply unused


def test_the_declared_count_is_found_in_sub_configs_and_one_expert_is_dense():
    assert declared_experts(_dbrx().config) == ("ffn_config.moe_num_experts", 4)
    assert declared_experts(transformers.MixtralConfig(num_local_experts=1)) is None
