"""LitGPT models under tensor parallelism (``layers/litgpt_plans.py``): the multi-head attention's
fused ``[q|k|v]`` is split in 3 packed chunks with per-attention head counts, a grouped-query one in
3 packed sections of unequal sizes, key/value groups fewer than ``tp`` replicated (tp a multiple of
them) or refused naming the plans that work, and tp=2 and tp=4 train like one device."""
import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from megastrategy.layers.shard_spec import ShardSpec, merge_shards, shard_full_tensor
from tests.helpers.litgpt_runs import assert_litgpt_matches_ddp, tiny_litgpt


def test_multi_head_attention_is_packed_qkv_with_local_head_counts_in_the_config():
    plan = resolve_tp_plan(tiny_litgpt(groups=4), None, 2)
    got = {e.name: (e.style, e.extra.get("packed_chunks", 1)) for e in plan.entries if e.style != "replicate"}
    block = "transformer.h.0"
    assert got[f"{block}.attn.qkv"] == ("column", 3) and got[f"{block}.attn.proj"] == ("row", 1)
    assert got[f"{block}.mlp.fc_1"] == got[f"{block}.mlp.fc_2"] == ("column", 1) and got[f"{block}.mlp.proj"][0] == "row"
    assert got["transformer.wte"][0] == got["lm_head"][0] == "vocab"
    fixups = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    assert fixups[(f"{block}.attn", "config.n_head")] == (4, 2)
    assert fixups[(f"{block}.attn", "config.n_query_groups")] == (4, 2)


def test_grouped_query_attention_is_split_in_unequal_sections_each_rank_its_own_groups():
    model = tiny_litgpt(groups=2)
    plan = resolve_tp_plan(model, None, 2)
    qkv = next(e for e in plan.entries if e.name == "transformer.h.0.attn.qkv")
    assert qkv.style == "column" and qkv.extra["packed_sections"] == (32, 16, 16)  # 4 q, 2 k, 2 v heads of 8
    fixups = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    assert fixups[("transformer.h.0.attn", "config.n_head")] == (4, 2)
    assert fixups[("transformer.h.0.attn", "config.n_query_groups")] == (2, 1)
    # rank r holds query heads 2r, 2r+1 and key/value head r: the group those query heads read
    spec = ShardSpec(0, 64, 64, packed_chunks=3, packed_sections=(32, 16, 16))
    rows = torch.arange(64)
    assert shard_full_tensor(rows, spec, 1, 2).tolist() == [*range(16, 32), *range(40, 48), *range(56, 64)]
    assert torch.equal(merge_shards([shard_full_tensor(rows, spec, r, 2) for r in range(2)], spec), rows)


def test_key_value_groups_fewer_than_tp_are_replicated_each_on_tp_over_groups_ranks():
    plan = resolve_tp_plan(tiny_litgpt(groups=2), None, 4)  # 2 groups at tp4: rank r reads group r // 2
    qkv = plan["transformer.h.0.attn.qkv"]
    assert qkv.style == "multi_query"
    assert {k: qkv.extra[k] for k in ("q_heads", "kv_heads", "head_dim", "kv_replicas")} == {
        "q_heads": 4, "kv_heads": 2, "head_dim": 8, "kv_replicas": 2}
    fixed = {f.attr: (f.old, f.new) for f in plan.fixups if f.module == "transformer.h.0.attn"}
    assert fixed == {"config.n_head": (4, 1), "config.n_query_groups": (2, 1)}


def test_key_value_groups_tp_neither_divides_nor_replicates_are_refused_naming_what_works():
    from litgpt.config import Config
    from litgpt.model import GPT

    from tests.helpers.litgpt_runs import VARIANTS

    model = GPT(Config(n_layer=2, n_embd=48, n_head=6, n_query_groups=2, block_size=32, vocab_size=128,
                       padded_vocab_size=128, intermediate_size=96, **VARIANTS["llama"]))
    with pytest.raises(MegatronConfigError) as e:  # 2 groups at tp3: a rank's 2 query heads, from two groups
        resolve_tp_plan(model, None, 3)
    message = str(e.value)
    assert "config.n_query_groups=2 of transformer.h.0.attn" in message and "use tp in {1, 2}" in message
    assert "'transformer.h.*.attn': 'replicate'" in message and "Or use tp in {6}" in message
    plan = resolve_tp_plan(model, {"*": "auto", "transformer.h.*.attn": "replicate"}, 3)
    sharded = {e.name for e in plan.entries if e.style != "replicate"}
    assert "transformer.h.0.mlp.fc_1" in sharded and "transformer.h.0.attn.qkv" not in sharded


def test_multi_query_splits_the_query_heads_and_keeps_the_key_value_head_whole():
    plan = resolve_tp_plan(tiny_litgpt(groups=1), None, 2)
    qkv = plan["transformer.h.0.attn.qkv"]
    assert qkv.style == "multi_query" and (qkv.extra["q_heads"], qkv.extra["kv_heads"], qkv.extra["head_dim"]) == (4, 1, 8)
    fixed = {f.attr: (f.old, f.new) for f in plan.fixups if f.module == "transformer.h.0.attn"}
    assert fixed == {"config.n_head": (4, 2)}  # n_query_groups stays 1: forward repeats the one head locally


@pytest.mark.timeout(500)
def test_litgpt_multi_head_grouped_and_multi_query_train_like_one_device_tp2():
    assert_litgpt_matches_ddp("--tp", "2", groups="4,2,1")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_litgpt_grouped_query_with_replicated_key_value_groups_trains_like_one_device_tp4():
    """4 heads in 4, 2 (each group on 2 ranks) and 1 key/value groups, in the reference's one launch order
    (each model's initial weights depend on the models built before it)."""
    from tests.helpers.litgpt_runs import REFERENCE_GROUPS, litgpt_run

    reference = litgpt_run(1, REFERENCE_GROUPS, "--strategy", "ddp")
    ours = litgpt_run(4, REFERENCE_GROUPS, "--strategy", "megatron", "--tp", "4")
    for g in REFERENCE_GROUPS.split(","):
        got = ours[g]["losses"] + [ours[g]["val_loss"]]
        want = reference[g]["losses"] + [reference[g]["val_loss"]]
        assert len(got) == len(want) == 4 and max(abs(a - b) for a, b in zip(got, want)) < 2e-4, (g, got, want)


@pytest.mark.parametrize("groups, packing", [(4, 3), (2, (32, 16, 16))])
def test_pythia_style_blocks_shard_their_gelu_mlp_and_biased_qkv(groups, packing):
    plan = resolve_tp_plan(tiny_litgpt(groups=groups, variant="neox"), None, 2)
    got = {e.name: (e.style, e.extra.get("packed_sections", e.extra.get("packed_chunks", 1)))
           for e in plan.entries if e.style != "replicate"}
    block = "transformer.h.3"
    assert got[f"{block}.attn.qkv"] == ("column", packing) and got[f"{block}.mlp.fc"] == ("column", 1)
    assert got[f"{block}.mlp.proj"] == ("row", 1)
