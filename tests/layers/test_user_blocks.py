"""tp=2 on hand-written transformers, unchanged, with auto-detection: nanoGPT, minGPT and a Llama
(tests/helpers/user_gpts.py) against Lightning's DDPStrategy on one process from the same seed,
per-step losses within 2e-4. One launch per layout trains every model (tests/scripts/user_blocks.py).

What each must get: the MLPs column/row everywhere; the attention head-sharded where the forward
reads its sizes from the module (the Llama: ``self.n_heads``, ``self.head_dim``) and kept whole,
with one warning, where it reads ``C`` from ``x.size()`` (nanoGPT, minGPT); the embedding and the
head (tied in nanoGPT) vocab-parallel.
"""
from __future__ import annotations

from pathlib import Path

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "user_blocks.py"
MODELS = ("nanogpt", "mingpt", "llama", "fused-mqa", "fused-gqa")
TOL = 2e-4


def _run(strategy: str, nprocs: int, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--strategy", strategy, "--models", ",".join(MODELS), *extra], timeout=300)


def _styles(plan: dict, suffix: str) -> set[str]:
    return {style for name, style in plan.items() if name.endswith(suffix)}


def test_tp2_matches_one_device_on_hand_written_transformers():
    ref, tp2 = _run("ddp", 1), _run("megatron", 2, "--tp", "2")
    for model in MODELS:
        assert "error" not in tp2[model], (model, tp2[model]["error"])
        worst = max(abs(a - b) for a, b in zip(tp2[model]["loss"], ref[model]["loss"]))
        assert len(tp2[model]["loss"]) == 3 and worst <= TOL, (model, tp2[model]["loss"], ref[model]["loss"])
    nano = tp2["nanogpt"]["plan"]
    assert _styles(nano, "mlp.c_fc") == {"column"} and _styles(nano, "mlp.c_proj") == {"row"}
    assert _styles(nano, "attn.c_attn") == _styles(nano, "attn.c_proj") == {"replicate (kept whole)"}
    (warning,) = tp2["nanogpt"]["warnings"]
    assert "'model.transformer.h.*.attn'" in warning and "not enough values to unpack" in warning, warning
    mingpt = tp2["mingpt"]["plan"]
    assert _styles(mingpt, "mlp.0") == {"column"} and _styles(mingpt, "mlp.2") == {"row"}
    assert _styles(mingpt, "attn.key") == {"replicate (kept whole)"}
    assert len(tp2["mingpt"]["warnings"]) == 1
    llama = tp2["llama"]["plan"]
    assert _styles(llama, "attention.wq") == {"column"} and _styles(llama, "attention.wo") == {"row"}
    assert _styles(llama, "feed_forward.w3") == {"column"} and _styles(llama, "feed_forward.w2") == {"row"}
    assert tp2["llama"]["warnings"] == []
    # one fused qkv: multi-query (query heads split, the key/value head whole on every rank) and grouped-query
    assert _styles(tp2["fused-mqa"]["plan"], "attn.qkv") == {"multi_query"}
    assert _styles(tp2["fused-gqa"]["plan"], "attn.qkv") == {"column"}
    for model in ("fused-mqa", "fused-gqa"):
        assert _styles(tp2[model]["plan"], "attn.proj") == {"row"} and tp2[model]["warnings"] == [], model
    for model, (emb, head) in {"nanogpt": ("transformer.wte", "lm_head"), "mingpt": ("tok_emb", "head"),
                               "llama": ("tok_embeddings", "output")}.items():
        assert tp2[model]["plan"][f"model.{emb}"] == tp2[model]["plan"][f"model.{head}"] == "vocab", model
