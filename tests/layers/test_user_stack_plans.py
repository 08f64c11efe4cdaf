"""Auto-detection on a user's own layer stack (megastrategy.layers.user_stack_plans): the dataflow
probe reads hand-written transformers (tests/helpers/user_gpts.py) as it reads Hugging Face models.
Pure: plans are resolved, nothing is sharded (tests/layers/test_user_blocks.py trains them)."""
from __future__ import annotations

from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.user_gpts import build
from tests.layers.test_plan import TinyGPT


def _block0(plan, prefix):
    return {e.name[len(prefix):]: (e.style, dict(e.extra)) for e in plan.entries if e.name.startswith(prefix)}


def test_nanogpt_attention_mlp_and_vocabulary_are_read():
    plan = resolve_tp_plan(build("nanogpt"), None, 2)
    got = _block0(plan, "transformer.h.0.")
    assert got["attn.c_attn"] == ("column", {"packed_chunks": 3, "unit": "NanoGPT.attention"})
    assert got["attn.c_proj"][0] == "row" and got["mlp.c_fc"][0] == "column" and got["mlp.c_proj"][0] == "row"
    assert plan["transformer.wte"].style == plan["lm_head"].style == "vocab"  # tied: tests/layers/test_user_vocab.py
    assert {(f.module, f.attr, f.old, f.new) for f in plan.fixups} == {
        (f"transformer.h.{i}.attn", "n_head", 4, 2) for i in range(2)}
    assert {e.source for e in plan.sharded} == {"structural:NanoGPT"}


def test_mingpt_and_llama():
    mingpt = _block0(resolve_tp_plan(build("mingpt"), None, 2), "blocks.0.")
    assert {n: s for n, (s, _) in mingpt.items()} == {
        "attn.key": "column", "attn.query": "column", "attn.value": "column", "attn.proj": "row",
        "mlp.0": "column", "mlp.2": "row"}
    plan = resolve_tp_plan(build("llama"), None, 2)
    llama = _block0(plan, "layers.0.")
    assert {n: s for n, (s, _) in llama.items()} == {
        "attention.wq": "column", "attention.wk": "column", "attention.wv": "column", "attention.wo": "row",
        "feed_forward.w1": "column", "feed_forward.w3": "column", "feed_forward.w2": "row"}
    assert {(f.attr, f.new) for f in plan.fixups if f.module == "layers.0.attention"} == {("n_heads", 2), ("n_kv_heads", 1)}


def test_mlp_beside_attention_in_one_module_is_an_mlp():
    """TinyGPT's block holds q/k/v/proj and fc/out side by side and counts heads: ``fc``'s output goes
    through a GELU first, so it is an MLP, not a packed projection."""
    plan = resolve_tp_plan(TinyGPT(), None, 2)
    assert plan.styles()["blocks.0.fc"] == "column" and plan.styles()["blocks.0.out"] == "row"
    assert plan.styles()["blocks.0.drop"] == "dropout" and plan.styles()["blocks.0.q"] == "column"


def test_a_plan_without_auto_is_used_as_given():
    plan = resolve_tp_plan(build("nanogpt"), {"transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row"}, 2)
    assert all(e.source.startswith("tp_plan[") for e in plan.sharded) and len(plan.sharded) == 4
    assert not plan.fixups
