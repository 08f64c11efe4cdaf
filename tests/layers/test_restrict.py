"""Cuts of a resolved plan for the block fallback (megastrategy.layers.plan.restrict): one block's
plan rebased onto the block, and the plan with blocks kept whole. Pure."""
from __future__ import annotations

from dataclasses import replace

from megastrategy.layers.plan import RNGRegion, resolve_tp_plan
from megastrategy.layers.plan.restrict import is_within, restrict_to_block, without_blocks
from tests.helpers.user_gpts import build


def _plan():
    plan = resolve_tp_plan(build("nanogpt"), None, 2)
    region = RNGRegion("transformer.h.0.attn", "transformer.h.0.attn.c_proj", "attn_dropout.p")
    return replace(plan, rng_regions=(region,))


def test_is_within():
    assert is_within("a.b", "a") and is_within("a", "a") and is_within("x", "")
    assert not is_within("ab", "a") and not is_within(None, "a")


def test_restrict_to_block_rebases_entries_fixups_and_rng_regions():
    part = restrict_to_block(_plan(), "transformer.h.0.attn")
    assert [(e.name, e.style) for e in part.entries] == [("block.c_attn", "column"), ("block.c_proj", "row")]
    assert [(f.module, f.attr, f.new) for f in part.fixups] == [("block", "n_head", 2)]
    assert part.rng_regions == (RNGRegion("block", "block.c_proj", "attn_dropout.p"),)
    assert part.tp_size == 2
    # a name in extra (the shared input copy) is rebased too
    llama = restrict_to_block(resolve_tp_plan(build("llama"), None, 2), "layers.0.attention")
    assert {e.extra.get("input_copy") for e in llama.entries if e.style == "column"} == {"block"}


def test_an_entry_naming_the_block_itself_is_kept_under_the_holders_name():
    """T5's attention takes its heads' slice of the position bias (an entry on the attention module
    itself); without it the trial copy failed and the fallback kept a block whole that shards fine."""
    from tests.helpers.hf_zoo import tiny_model

    plan = resolve_tp_plan(tiny_model("t5"), None, 2)
    name = next(e.name for e in plan.entries if e.name.endswith("block.0.layer.0.SelfAttention"))
    part = restrict_to_block(plan, name, "held")
    assert "held" in part.styles() and all(e.name == "held" or e.name.startswith("held.") for e in part.entries)


def test_without_blocks_keeps_them_whole():
    plan = _plan()
    cut = without_blocks(plan, ["transformer.h.0.attn", "transformer.h.1.attn"])
    styles = cut.styles()
    assert styles["transformer.h.0.attn.c_attn"] == styles["transformer.h.1.attn.c_proj"] == "replicate"
    assert cut["transformer.h.0.attn.c_attn"].source == "structural:NanoGPT (kept whole)"
    assert cut["transformer.h.0.attn.c_attn"].extra == {}
    assert styles["transformer.h.0.mlp.c_fc"] == "column" and styles["transformer.h.1.mlp.c_proj"] == "row"
    assert not cut.fixups and not cut.rng_regions
    assert len(cut.entries) == len(plan.entries)
