"""``megastrategy plan``: the plan of a model type or an import path, printed without running it."""
from __future__ import annotations

from megastrategy.cli import main


def test_plan_of_an_encoder_type(capsys):
    assert main(["plan", "roberta", "--task", "mlm", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("RobertaForMaskedLM: tp=2, 74 module(s) sharded")
    assert "roberta.encoder.layer.*.attention.self.query    column  built-in (roberta)  12" in out
    assert "lm_head.decoder" in out and "replicated (whole on every rank): " in out
    assert "parameters per rank: 62,870,573 of 124,696,665 (50.4%)" in out  # base size, meta device


def test_plan_of_a_declared_decoder_and_a_user_glob(capsys):
    main(["plan", "qwen3", "--tp", "8", "--tp-plan", '{"*": "auto", "model.layers.0": "replicate"}'])
    out = capsys.readouterr().out
    assert "model.layers.*.self_attn.q_norm  grad_sum  declared by transformers (qwen3)  31" in out  # 32 layers, one kept whole
    assert "model.layers.0.self_attn.q_proj" in out.split("replicated (whole on every rank): ")[1]


def test_plan_of_an_import_path(capsys):
    main(["plan", "tests.helpers.models:EncoderClassifier", "--tp", "2"])
    out = capsys.readouterr().out
    assert "encoder.layers.*.self_attn  attention  built-in (torch)" in out


def test_plan_of_a_moe_decoder_leaves_fused_experts_to_expert_parallelism(capsys):
    # Mixtral declares packed_colwise on its fused expert tensors, which TP cannot shard exactly:
    # they stay whole on every TP rank and ep splits them; the parameter count says so.
    assert main(["plan", "mixtral", "--tp", "2", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.self_attn.q_proj  column  declared by transformers (mixtral)  32" in out
    assert "experts (whole on every TP rank; split over ep=4 by expert parallelism): model.layers.*.mlp.experts" in out
    assert "mlp.experts  " not in out.split("experts (whole")[0]  # not in the sharded table
    assert "parameters per rank: 12,077,764,608 of 46,702,792,704 (25.9%)" in out
