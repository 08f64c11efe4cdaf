"""The fallback decision (megastrategy.layers.block_fallback): which failing blocks are kept whole,
and the one warning (pure); and, on two processes, a declared Hugging Face plan that fails the
check falling back too (hand-written models train in tests/layers/test_user_blocks.py)."""
from __future__ import annotations

from megastrategy.layers.block_fallback import blocks_to_keep_whole, fallback_warning
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.dist import run_distributed
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
    assert DETAIL in text and f"hold {share:.1%} of the model's parameters" in text
    assert "y.view(B, T, -1)" in text and "tp_plan={'*': 'auto', 'transformer.h.*.attn': 'replicate'}" in text


def _fallback_then_verify(rank, world, arch):
    """Capture, decide, shard the real model with the reduced plan, and run the post-sharding check."""
    import torch
    import torch.distributed as dist

    from megastrategy.layers.block_capture import capture_blocks
    from megastrategy.layers.block_check import verify_sharded_blocks
    from megastrategy.layers.block_fallback import keep_failing_blocks_whole
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
    from megastrategy.layers.random import ModelParallelRNGTracker
    from tests.helpers.hf_zoo import tiny_model

    model = tiny_model(arch)
    plan = resolve_tp_plan(model, None, 2)
    tracker = ModelParallelRNGTracker(tp_rank=rank, device=torch.device("cpu"))
    tracker.seed(0)
    plan, captured = keep_failing_blocks_whole(model, plan, capture_blocks(model, plan), dist.group.WORLD, 2, tracker)
    apply_tp_plan(model, plan, group=dist.group.WORLD, rng_tracker=tracker)
    verify_sharded_blocks(model, captured, dist.group.WORLD, 2)
    return {e.name: e.style for e in plan.entries if e.source.endswith("(kept whole)")}, [c.name for c in captured]


def test_a_declared_plan_that_fails_falls_back_too_tp2():
    """transformers' own Apertus plan shards the MLP around xIELU, whose learnable alphas would get
    partial gradients: its MLPs are kept whole (numbers stay exact), the attention stays sharded."""
    kept, verified = run_distributed(_fallback_then_verify, 2, "apertus", timeout=120)[0]
    assert kept and all(".mlp." in n for n in kept) and set(kept.values()) == {"replicate"}
    assert verified == ["model.layers.0.self_attn"]
