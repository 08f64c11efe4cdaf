"""The fallback decision (megastrategy.layers.block_fallback): which failing blocks are kept whole,
and the one warning. Pure parts only: the trial sharding on two processes is covered by
tests/layers/test_user_blocks.py."""
from __future__ import annotations

from megastrategy.layers.block_fallback import blocks_to_keep_whole, fallback_warning
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.user_gpts import build

DETAIL = "its forward raised ValueError: not enough values to unpack (expected 3, got 2)"


def test_a_failing_auto_block_is_kept_whole_with_every_block_of_its_signature():
    model = build("nanogpt")
    plan = resolve_tp_plan(model, None, 2)
    keep = blocks_to_keep_whole(model, plan, {"transformer.h.0.attn": DETAIL})
    assert keep == {"transformer.h.0.attn": DETAIL, "transformer.h.1.attn": DETAIL}
    assert blocks_to_keep_whole(model, plan, {}) == {}


def test_a_block_the_user_named_is_not_kept_whole():
    """Its entries come from tp_plan: the post-sharding check refuses, as before."""
    model = build("nanogpt")
    plan = resolve_tp_plan(model, {"*": "auto", "transformer.h.*.attn.c_attn": "column", "transformer.h.*.attn.c_proj": "row"}, 2)
    assert blocks_to_keep_whole(model, plan, {"transformer.h.0.attn": DETAIL}) == {}


def test_the_warning_names_blocks_reason_share_and_fix():
    model = build("nanogpt")
    text = fallback_warning(model, {"transformer.h.0.attn": DETAIL, "transformer.h.1.attn": DETAIL}, 2)
    attn = sum(p.numel() for n, p in model.named_parameters() if ".attn." in n)
    share = attn / sum(p.numel() for p in model.parameters())
    assert "keeping 2 auto-detected block(s) whole" in text and "'transformer.h.*.attn'" in text
    assert DETAIL in text and f"{share:.1%} of the parameters stay unsharded" in text
    assert "y.view(B, T, -1)" in text and "tp_plan={'*': 'auto', 'transformer.h.*.attn': 'replicate'}" in text
