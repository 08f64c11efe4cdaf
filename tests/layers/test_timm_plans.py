"""timm Vision Transformers under tensor parallelism (``layers/timm_plans.py``): the fused
``[q|k|v]`` is split in 3 packed chunks with ``num_heads`` and ``attn_dim`` divided, the MLP is
column/row, and tp=2 trains like one device. Skipped where timm cannot be imported."""
import pytest

from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.timm_runs import assert_vit_matches_ddp, tiny_vit


def test_vit_attention_is_packed_qkv_with_local_heads_and_width():
    plan = resolve_tp_plan(tiny_vit(), None, 2)
    got = {e.name: (e.style, e.extra.get("packed_chunks", 1)) for e in plan.entries if e.style != "replicate"}
    assert got["blocks.0.attn.qkv"] == ("column", 3) and got["blocks.0.attn.proj"] == ("row", 1)
    assert got["blocks.0.mlp.fc1"] == ("column", 1) and got["blocks.0.mlp.fc2"] == ("row", 1)
    fixups = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    assert fixups[("blocks.0.attn", "num_heads")] == (4, 2) and fixups[("blocks.0.attn", "attn_dim")] == (32, 16)


@pytest.mark.timeout(500)
def test_vit_trains_like_one_device_tp2():
    assert_vit_matches_ddp("--tp", "2")
