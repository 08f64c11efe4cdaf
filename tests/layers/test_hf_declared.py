"""Hugging Face's declared tp_plan translated into plan entries (pure: no processes)."""
from __future__ import annotations

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.hf_declared import declared_plan
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.hf_zoo import DECLARED_DECODERS, tiny_model


@pytest.mark.parametrize("arch", DECLARED_DECODERS)
def test_every_declared_decoder_resolves_at_tp2(arch):
    plan = resolve_tp_plan(tiny_model(arch), None, 2)
    assert plan.architectures and all(e.source.startswith("declared:") for e in plan.sharded)
    assert {"column", "row"} <= {e.style for e in plan.sharded}


def test_llama_translation_and_precedence_over_builtin():
    plan = resolve_tp_plan(tiny_model("llama"), None, 2)
    pre = "model.layers.0."
    assert plan[pre + "self_attn.q_proj"].style == "column" and plan[pre + "self_attn.o_proj"].style == "row"
    assert plan[pre + "self_attn.q_proj"].source == "declared:llama"  # declared beats the class rules
    # q/k/v read the same tensor: one shared input copy, one backward all-reduce
    assert {plan[pre + f"self_attn.{p}_proj"].extra["input_copy"] for p in "qkv"} == {pre + "self_attn"}
    assert plan["model.embed_tokens"].style == "vocab" and plan["lm_head"].style == "vocab"  # lm_head: vocab-parallel
    assert plan.rng_regions[0].module == pre + "self_attn"


def test_gather_split_packed_and_grad_sum_styles():
    phi3 = resolve_tp_plan(tiny_model("phi3"), None, 2)  # colwise_gather_output / rowwise_split_input
    assert phi3["model.layers.0.self_attn.qkv_proj"].extra["gather_output"] is True
    assert phi3["model.layers.0.self_attn.o_proj"].extra["split_input"] is True
    assert phi3.fixups == ()  # gathered outputs: the forward sees all heads, nothing divided
    qwen3 = resolve_tp_plan(tiny_model("qwen3"), None, 2)  # replicated_with_grad_allreduce
    assert qwen3["model.layers.0.self_attn.q_norm"].style == "grad_sum"
    neox = resolve_tp_plan(tiny_model("gpt_neox"), None, 2)  # embedding_rowwise
    assert neox["gpt_neox.embed_in"].style == "vocab" and neox["lm_head"].style == "vocab"


def test_scaled_embedding_and_its_tied_head_stay_whole():
    model = tiny_model("gemma")  # GemmaTextScaledWordEmbedding multiplies in its own forward
    model.lm_head.weight = model.model.embed_tokens.weight
    plan = resolve_tp_plan(model, None, 2)
    assert plan["model.embed_tokens"].style == "replicate" and plan["lm_head"].style == "replicate"


def test_user_glob_beats_the_declaration():
    plan = resolve_tp_plan(tiny_model("llama"), {"*": "auto", "model.layers.1": "replicate"}, 2)
    assert plan["model.layers.1.mlp.up_proj"].style == "replicate"
    assert plan["model.layers.0.mlp.up_proj"].style == "column"


def test_heads_must_divide_tp_or_be_replicated_by_it():
    """tp dividing the key/value heads splits them; a multiple of them replicates them; any other tp is refused,
    naming both ways."""
    model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=48, intermediate_size=96)
    with pytest.raises(MegatronConfigError, match=r"tp=3 does not divide config\.num_key_value_heads=2 of "
                                                  r"model\.layers\.0\.self_attn.*use tp in \{1, 2\}\. Or use tp in "
                                                  r"\{6\}: a multiple of the 2 key/value head\(s\)"):
        resolve_tp_plan(model, None, 3)
    assert resolve_tp_plan(model, None, 6)["model.layers.0.self_attn.k_proj"].style == "kv_whole"
    with pytest.raises(MegatronConfigError, match=r"tp=8 does not divide config\.num_attention_heads=4"):
        resolve_tp_plan(tiny_model("llama"), None, 8)  # 2 key/value heads, but 4 query heads


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fewer_key_value_heads_than_tp_are_replicated(arch):
    """2 key/value heads at tp4 (Qwen2.5-1.5B's layout): each rank computes the key/value head its query head
    reads (kv_whole, 2 ranks per head); the attention counts 4/4 = 1 query head per key/value head."""
    plan = resolve_tp_plan(tiny_model(arch), None, 4)
    attn = "model.layers.0.self_attn"
    assert [plan[f"{attn}.{p}_proj"].style for p in "qkvo"] == ["column", "kv_whole", "kv_whole", "row"]
    assert {k: plan[f"{attn}.k_proj"].extra[k] for k in ("kv_heads", "head_dim", "kv_replicas")} == {
        "kv_heads": 2, "head_dim": 8, "kv_replicas": 2}
    assert {(f.attr, f.old, f.new) for f in plan.fixups if f.module == attn} == {("num_key_value_groups", 2, 1)}
    at_tp2 = resolve_tp_plan(tiny_model(arch), None, 2)  # one key/value head per rank: split as declared
    assert [at_tp2[f"{attn}.{p}_proj"].style for p in "qkv"] == ["column"] * 3
    assert not [f for f in at_tp2.fixups if f.module == attn]


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_one_key_value_head_keeps_the_declared_k_v_projections_whole(arch):
    """Multi-query (Gemma-2B): a one-head k_proj/v_proj cannot be split; each rank computes it whole
    (kv_whole) while the query heads are split as declared, and the query groups are divided."""
    plan = resolve_tp_plan(tiny_model(arch, num_key_value_heads=1), None, 2)
    attn = "model.layers.0.self_attn"
    styles = {n.rsplit(".", 1)[-1]: plan[f"{attn}.{n}"].style for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert styles == {"q_proj": "column", "k_proj": "kv_whole", "v_proj": "kv_whole", "o_proj": "row"}
    assert {(f.attr, f.old, f.new) for f in plan.fixups if f.module == attn} == {("num_key_value_groups", 4, 2)}
    with pytest.raises(MegatronConfigError, match=r"num_attention_heads=4 .*use tp in \{1, 2, 4\}"):
        resolve_tp_plan(tiny_model(arch, num_key_value_heads=1), None, 8)


def test_untranslatable_style_is_refused_by_name():
    model = tiny_model("llama")
    model._tp_plan = dict(model._tp_plan, **{"model.layers.*.mlp": "moe_tp_experts"})
    refused = declared_plan(model).refused
    assert refused and refused[0].module == "model.layers.0.mlp" and refused[0].style == "moe_tp_experts"
    with pytest.raises(MegatronConfigError, match=r"declares tensor-parallel style 'moe_tp_experts' for "
                                                  r"'model\.layers\.0\.mlp'.*tp_plan=\{'\*': 'auto', "
                                                  r"'model\.layers\.\*\.mlp': 'replicate'\}"):
        resolve_tp_plan(model, None, 2)
    resolve_tp_plan(model, None, 1)  # nothing is sharded at tp=1: no refusal
    plan = resolve_tp_plan(model, {"*": "auto", "model.layers.*.mlp": "replicate"}, 2)  # the user decides
    assert plan["model.layers.0.mlp.up_proj"].style == "replicate"


def test_declared_parameter_keys_are_refused():
    model = tiny_model("llama")
    model._tp_plan = dict(model._tp_plan, **{"model.layers.*.mlp.up_proj.weight": "colwise"})
    with pytest.raises(MegatronConfigError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*names a parameter"):
        resolve_tp_plan(model, None, 2)


def test_experts_of_any_layout_stay_whole_where_the_declaration_names_their_parameters():
    """Llama 4 declares 'packed_rowwise' on its experts' bare [E, H, 2F] parameter: kept whole (exact),
    as fused experts are; its attention and shared expert are sharded as declared."""
    plan = resolve_tp_plan(tiny_model("llama4_text"), None, 2)
    assert not any(".experts" in e.name for e in plan.sharded)
    assert plan["model.layers.1.feed_forward.shared_expert.up_proj"].style == "column"
    assert plan["model.layers.0.self_attn.o_proj"].style == "row"
