"""Structural detection (megastrategy.layers.structural_plans): the TP plan of a Hugging Face
model that declares none and has no built-in rules, read from its traced data flow; ambiguous
packings are refused, and a wrong reading is refused by the setup-time block check."""
from __future__ import annotations

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.dist import run_distributed
from tests.helpers.hf_zoo import tiny_model


def _sharded(plan):
    return {e.name: (e.style, e.extra.get("packed_chunks", 1), e.source) for e in plan.entries if e.style != "replicate"}


def test_falcon_grouped_query_packing_is_split_by_kv_groups():
    plan = resolve_tp_plan(tiny_model("falcon"), None, 2)  # 8 heads, 2 kv groups: [2, 4 + 2, 4]
    got = _sharded(plan)
    attn, mlp = "transformer.h.0.self_attention", "transformer.h.0.mlp"
    assert got[f"{attn}.query_key_value"] == ("column", 1, "structural:falcon")
    assert got[f"{attn}.dense"] == ("row", 1, "structural:falcon")
    assert got[f"{mlp}.dense_h_to_4h"][0] == "column" and got[f"{mlp}.dense_4h_to_h"][0] == "row"
    assert got["transformer.word_embeddings"][0] == got["lm_head"][0] == "vocab"
    fixups = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    assert fixups[(attn, "num_heads")] == (8, 4) and fixups[(attn, "num_kv_heads")] == (2, 1)
    assert len(got) == 2 + 4 * 2  # nothing else in the blocks


def test_an_attention_width_attribute_is_divided_with_the_heads():
    """XGLM reshapes its local heads with ``self.embed_dim``: divided with ``num_heads``; the decoder
    layer's own ``embed_dim`` (the residual width) is left whole."""
    plan = resolve_tp_plan(tiny_model("generic.xglm"), None, 2)
    fixups = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    attn = "model.layers.0.self_attn"
    assert fixups[(attn, "num_heads")] == (4, 2) and fixups[(attn, "embed_dim")] == (32, 16)
    assert ("model.layers.0", "embed_dim") not in fixups


def test_persimmon_per_head_norms_sum_their_gradients():
    got = _sharded(resolve_tp_plan(tiny_model("persimmon"), None, 2))
    attn = "model.layers.1.self_attn"
    assert got[f"{attn}.query_key_value"][:2] == ("column", 1)
    assert got[f"{attn}.q_layernorm"][0] == got[f"{attn}.k_layernorm"][0] == "grad_sum"
    assert got[f"{attn}.dense"][0] == "row"


def test_bart_cross_attention_takes_q_from_the_decoder_and_k_v_from_the_encoder():
    plan = resolve_tp_plan(tiny_model("bart"), None, 2)
    got = _sharded(plan)
    cross = "model.decoder.layers.1.encoder_attn"
    assert {got[f"{cross}.{p}"][0] for p in ("q_proj", "k_proj", "v_proj")} == {"column"}
    assert got[f"{cross}.out_proj"] == ("row", 1, "structural:bart")
    assert got["model.encoder.layers.0.fc1"][0] == "column" and got["model.encoder.layers.0.fc2"][0] == "row"
    # one embedding shared by encoder, decoder and the tied head, scaled by its own forward: whole
    replicated = {e.name for e in plan.entries if e.style == "replicate"}
    assert {"model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens", "lm_head"} <= replicated
    fixups = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    assert fixups[(cross, "num_heads")] == (4, 2)


@pytest.mark.parametrize("arch, task, block", [
    ("vit", "img", "vit.layers.1"),  # random pixels: attention q/k/v/o and fc1/fc2
    ("wav2vec2", "audio", "wav2vec2.encoder.layers.1"),  # a random waveform
    ("convnext", "img", "convnext.encoder.stages.1.layers.0"),  # an MLP only, no token embeddings
])
def test_vision_and_audio_models_are_traced_on_their_own_inputs(arch, task, block):
    got = _sharded(resolve_tp_plan(tiny_model(arch, task=task), None, 2))
    styles = {n[len(block) + 1:]: style for n, (style, _, source) in got.items() if n.startswith(block + ".")}
    assert all(source == f"structural:{arch}" for _, _, source in got.values())
    assert sorted(styles.values()).count("row") == (1 if arch == "convnext" else 2), styles
    assert "column" in styles.values()


def test_swins_relative_position_bias_module_follows_the_heads():
    """A module holding a [positions, heads] table, called by the attention for a bias per head."""
    got = _sharded(resolve_tp_plan(tiny_model("swin", task="img"), None, 2))
    attn = "swin.encoder.layers.1.blocks.0.attention"
    assert got[f"{attn}.relative_position_bias"][0] == "head_table"
    assert got[f"{attn}.q_proj"][0] == "column" and got[f"{attn}.o_proj"][0] == "row"


def test_whisper_is_traced_on_mel_features():
    got = _sharded(resolve_tp_plan(tiny_model("whisper"), None, 2))
    assert got["model.encoder.layers.0.self_attn.out_proj"][0] == "row"
    assert got["model.decoder.layers.1.encoder_attn.k_proj"][0] == "column"


def test_t5_relative_position_bias_follows_the_heads():
    got = _sharded(resolve_tp_plan(tiny_model("t5"), None, 2))
    attn = "encoder.block.0.layer.0.SelfAttention"
    assert {got[f"{attn}.{p}"][0] for p in "qkv"} == {"column"} and got[f"{attn}.o"][0] == "row"
    assert got[f"{attn}.relative_attention_bias"][0] == "head_table"
    assert got[attn][0] == got["decoder.block.1.layer.1.EncDecAttention"][0] == "head_bias_input"
    gated = _sharded(resolve_tp_plan(tiny_model("t5", feed_forward_proj="gated-gelu"), None, 2))
    ffn = "decoder.block.1.layer.2.DenseReluDense"
    assert gated[f"{ffn}.wi_0"][0] == gated[f"{ffn}.wi_1"][0] == "column" and gated[f"{ffn}.wo"][0] == "row"


def test_equal_chunk_split_is_read_as_packed_chunks():
    from megastrategy.layers.dataflow import FirstUse
    from megastrategy.layers.structural_plans import _packing

    split = FirstUse("split", (2, 8, 96), ((2, 8, 32),) * 3)
    assert _packing(split, {4}) == 3
    assert "unequal" in _packing(FirstUse("split", (2, 8, 46), ((2, 8, 32), (2, 8, 8), (2, 8, 6))), {4, 1})
    # [q | k | v] with one key/value head: multi-query (tests/layers/test_multi_query.py)
    assert _packing(FirstUse("split", (2, 8, 48), ((2, 8, 32), (2, 8, 8), (2, 8, 8))), {4, 1}).kv_heads == 1
    assert _packing(FirstUse("view", (2, 8, 96), ((2, 8, 3, 4, 8),)), {4}) == 3  # [q|k|v, heads, dim]


@pytest.mark.parametrize(
    "overrides, reason",
    [
        # 4 heads in 2 groups viewed as [2, 4, 8]: 2 groups of (2 q + k + v), or [k|v] chunks of 4 heads?
        (dict(num_attention_heads=4, num_kv_heads=2), "leave two readings"),
    ],
)
def test_a_packing_structure_cannot_tell_is_refused(overrides, reason):
    with pytest.raises(MegatronConfigError) as err:
        resolve_tp_plan(tiny_model("falcon", **overrides), None, 2)
    msg = str(err.value)
    assert "'transformer.h.0.self_attention'" in msg and "'transformer.h.0.self_attention.query_key_value'" in msg
    assert reason in msg and "'transformer.h.*.self_attention': 'replicate'" in msg
    model = tiny_model("falcon", **overrides)  # the remedy the message gives works
    plan = resolve_tp_plan(model, {"*": "auto", "transformer.h.*.self_attention": "replicate"}, 2)
    assert _sharded(plan)["transformer.h.0.mlp.dense_4h_to_h"] == ("row", 1, "structural:falcon")


def test_plan_report_names_the_structural_source():
    from megastrategy.layers.plan_report import plan_report

    model = tiny_model("persimmon")
    report = plan_report(model, resolve_tp_plan(model, None, 2))
    assert "model.layers.*.self_attn.query_key_value" in report
    assert "structural (persimmon: traced data flow)" in report
    assert report.splitlines()[-1].startswith("note: this is the plan before the block check")  # not what runs


def test_megastrategy_plan_traces_a_meta_device_model():
    from megastrategy.layers.plan_report import report_for

    report = report_for("persimmon", 2)  # Persimmon-8B's default config, never materialized
    assert "model.layers.*.self_attn.query_key_value  column" in report
    assert "model.layers.*.self_attn.q_layernorm      grad_sum" in report and "(50.0%)" in report
    with pytest.raises(MegatronConfigError, match="num_heads=71"):  # Falcon-7B: multi-query, 71 query heads
        report_for("falcon", 2)
    t5 = report_for("t5", 2, task="s2s")  # t5-small's default config, an encoder-decoder
    assert "encoder.block.*.layer.*.SelfAttention.relative_attention_bias  head_table" in t5
    assert "decoder.block.*.layer.*.EncDecAttention.q" in t5 and "replicated (whole on every rank): shared," in t5


def _verify(rank, world):
    from tests.layers.test_block_check import _shard_and_verify

    out = {}
    cases = {"falcon": {}, "persimmon": {}, "bart": {}, "falcon_alibi": dict(alibi=True), "t5": {},
             "t5_gated": dict(feed_forward_proj="gated-gelu"), "gpt_bigcode": {}, "falcon_mqa": dict(
                 new_decoder_architecture=False, multi_query=True, num_attention_heads=4, num_kv_heads=None)}
    for name, overrides in cases.items():
        arch = name if name == "gpt_bigcode" else name.split("_")[0]
        try:
            out[name] = ("ok", _shard_and_verify(tiny_model(arch, **overrides), None, rank))
        except MegatronConfigError as e:
            out[name] = ("refused", str(e))
    return out


@pytest.mark.slow
def test_structural_blocks_are_verified_and_a_wrong_reading_is_refused_tp2():
    ranks = run_distributed(_verify, 2, timeout=300)
    assert {k: v[0] for k, v in ranks[0].items()} == {k: v[0] for k, v in ranks[1].items()}
    res = ranks[0]
    assert res["falcon"] == ("ok", (["transformer.h.0.self_attention", "transformer.h.0.mlp"], 15168, 15168))
    assert res["persimmon"][0] == "ok" and res["persimmon"][1][0] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    # ALiBi: the model builds its bias for all heads and the attention views it by its local
    # head count; the traced flow cannot see that, the block check does
    status, msg = res["falcon_alibi"]
    assert status == "refused" and "'transformer.h.0.self_attention'" in msg and "structural:falcon" in msg
    assert "its forward raised RuntimeError" in msg
    assert res["bart"][0] == "ok"
    assert "model.decoder.layers.0.encoder_attn" in res["bart"][1][0]
    # T5: layer 0's narrowed bias table, and a later layer fed the unsharded run's full-head bias
    assert res["t5"][0] == "ok"
    assert {"encoder.block.0.layer.0.SelfAttention", "encoder.block.1.layer.0.SelfAttention"} <= set(res["t5"][1][0])
    assert res["t5_gated"][0] == "ok" and "encoder.block.0.layer.1.DenseReluDense" in res["t5_gated"][1][0]
    # multi-query: the query heads split, the key/value head whole on each rank (gradient summed over tp)
    assert res["gpt_bigcode"] == ("ok", (["transformer.h.0.attn", "transformer.h.0.mlp"], 14944, 14944))
    assert res["falcon_mqa"][0] == "ok" and res["falcon_mqa"][1][0][0] == "transformer.h.0.self_attention"
