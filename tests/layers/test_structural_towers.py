"""Structural detection of the towers and encoders the sweep found refused with "no known block"
(megastrategy.layers.structural_plans): BERT's layout (columns and row in sibling modules), CLIP's
towers traced on images sized by ``vision_config``, DeBERTa v1's packed ``in_proj`` with its per-head
``q_bias``/``v_bias``, and the attentions left whole (Longformer, ConvBERT) while their MLPs are sharded."""
from __future__ import annotations

import warnings

import pytest
import transformers

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.dist import run_distributed
from tests.helpers.tiny_configs import tiny_config
from tests.scripts.hf_sweep_tasks import build_model


def _styles(plan, block: str) -> dict[str, str]:
    return {e.name[len(block) + 1:]: e.style for e in plan.entries
            if e.name.startswith(block + ".") and e.style != "replicate"}


def _deberta(**overrides):
    config = tiny_config("deberta")
    for k, v in overrides.items():
        setattr(config, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.DebertaForMaskedLM(config)


def test_bert_layout_regions_span_sibling_modules():
    plan = resolve_tp_plan(build_model("data2vec-vision", "img"), None, 2)
    got = _styles(plan, "data2vec_vision.encoder.layer.0")
    assert got == {"attention.attention.query": "column", "attention.attention.key": "column",
                   "attention.attention.value": "column", "attention.output.dense": "row",
                   "intermediate.dense": "column", "output.dense": "row"}
    heads = {(f.module.rsplit(".", 1)[-1], f.attr) for f in plan.fixups if ".layer.0." in f.module}
    assert heads == {("attention", "num_attention_heads"), ("attention", "all_head_size")}


def test_an_mlp_only_block_is_sharded():  # FNet: Fourier mixing, no attention projections
    got = _styles(resolve_tp_plan(build_model("fnet", "mlm"), None, 2), "fnet.encoder.layer.0")
    assert got == {"intermediate.dense": "column", "output.dense": "row"}


@pytest.mark.parametrize("arch", ["clip", "metaclip_2", "siglip"])
def test_vision_towers_are_traced_on_images_the_vision_config_sizes(arch):
    got = _styles(resolve_tp_plan(build_model(arch, "img"), None, 2), "vision_model.encoder.layers.0")
    assert got == {"self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
                   "self_attn.out_proj": "row", "mlp.fc1": "column", "mlp.fc2": "row"}


def test_a_dual_encoder_is_traced_on_ids_and_images():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.CLIPModel(tiny_config("clip"))
    plan = resolve_tp_plan(model, None, 2)
    for tower in ("text_model", "vision_model"):
        assert _styles(plan, f"{tower}.encoder.layers.1")["self_attn.out_proj"] == "row"


def test_deberta_v1_packed_projection_and_per_head_biases():
    plan = resolve_tp_plan(_deberta(relative_attention=True, pos_att_type=["c2p", "p2c"]), None, 2)
    entries = {e.name: e for e in plan.entries}
    own = entries["deberta.encoder.layer.0.attention.self"]
    assert own.style == "head_vector" and own.extra["params"] == ("q_bias", "v_bias")
    got = _styles(plan, "deberta.encoder.layer.0.attention")
    assert got == {"self": "head_vector", "self.in_proj": "column", "self.pos_proj": "column",
                   "self.pos_q_proj": "column", "output.dense": "row"}
    assert entries["deberta.encoder.layer.0.attention.self.in_proj"].extra.get("packed_chunks", 1) == 1  # heads outermost


@pytest.mark.parametrize("arch, task, block", [
    ("longformer", "cls", "longformer.encoder.layer.0"),  # asserts/reshapes with the full embed_dim
    ("longformer", "mlm", "longformer.encoder.layer.0"),  # global projections never run on the probe
    ("convbert", "mlm", "convbert.encoder.layer.0"),  # span-based conv: conv_kernel_layer mixes all heads
])
def test_attentions_that_cannot_run_on_local_heads_stay_whole(arch, task, block):
    got = _styles(resolve_tp_plan(build_model(arch, task), None, 2), block)
    assert got == {"intermediate.dense": "column", "output.dense": "row"}


def _verify(rank, world):
    from tests.layers.test_block_check import _shard_and_verify

    builders = {
        "deberta_rel": lambda: _deberta(relative_attention=True, pos_att_type=["c2p", "p2c"]),
        "data2vec-vision": lambda: build_model("data2vec-vision", "img"),
        "longformer": lambda: build_model("longformer", "cls"),
    }
    out = {}
    for name, build in builders.items():
        try:
            out[name] = ("ok", _shard_and_verify(build(), None, rank)[0])
        except MegatronConfigError as e:
            out[name] = ("refused", str(e))
    return out


@pytest.mark.slow
def test_tower_blocks_pass_the_block_check_tp2():
    ranks = run_distributed(_verify, 2, timeout=300)
    assert ranks[0] == ranks[1]
    res = ranks[0]
    assert res["deberta_rel"][0] == "ok" and "deberta.encoder.layer.0.attention" in res["deberta_rel"][1], res
    assert res["data2vec-vision"][0] == "ok", res
    assert res["longformer"] == ("ok", ["longformer.encoder.layer.0"]), res


def test_a_model_a_built_in_rule_recognized_keeps_its_embeddings_and_head_whole():
    # MobileBERT: its attention and first MLP by the BERT-layout rule, its extra FFNs structurally; the
    # MLM head multiplies by decoder.weight itself, so neither it nor the embedding may be vocab-sharded
    plan = resolve_tp_plan(build_model("mobilebert", "mlm"), None, 2)
    styles = {e.name: e.style for e in plan.entries}
    assert styles["mobilebert.encoder.layer.0.ffn.0.output.dense"] == "row"
    assert "vocab" not in styles.values()


@pytest.mark.parametrize("cls, arch", [("CLIPVisionModel", "clip"), ("SiglipVisionModel", "siglip")])
def test_a_vision_tower_inside_a_users_module_is_sharded(cls, arch):
    """A VLM's image encoder: the tower alone (its own vision config) under the user's head."""
    from torch import nn

    class ImageClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = getattr(transformers, cls)(tiny_config(arch).vision_config)
            self.head = nn.Linear(32, 3)

        def forward(self, pixel_values):
            return self.head(self.tower(pixel_values=pixel_values).pooler_output)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = ImageClassifier()
    rows = [e.name for e in resolve_tp_plan(module, None, 2).entries if e.style == "row"]
    assert len(rows) == 2 * 2 and all(n.startswith("tower.") for n in rows), rows  # 2 layers x (attention, MLP)


def test_siglip2_is_traced_on_patches_with_their_grid():
    got = _styles(resolve_tp_plan(build_model("siglip2", "patches"), None, 2), "vision_model.encoder.layers.0")
    assert got["self_attn.out_proj"] == "row" and got["mlp.fc2"] == "row"
