"""Built-in plans for the Hugging Face encoders that declare none (pure: no processes)."""
from __future__ import annotations

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.hf_zoo import ENCODERS, tiny_model

_HEADS = {
    "roberta": ("roberta.encoder.layer.0.attention.self", "lm_head.decoder", "roberta.embeddings.word_embeddings"),
    "xlm-roberta": ("roberta.encoder.layer.0.attention.self", "lm_head.decoder", "roberta.embeddings.word_embeddings"),
    "camembert": ("roberta.encoder.layer.0.attention.self", "lm_head.decoder", "roberta.embeddings.word_embeddings"),
    "electra": ("electra.encoder.layer.0.attention.self", "generator_lm_head", "electra.embeddings.word_embeddings"),
    "distilbert": ("distilbert.transformer.layer.0.attention", "vocab_projector",
                   "distilbert.embeddings.word_embeddings"),
    "albert": ("albert.encoder.albert_layer_groups.0.albert_layers.0.attention", "predictions.decoder",
               "albert.embeddings.word_embeddings"),
    "deberta-v2": ("deberta.encoder.layer.0.attention.self", "cls.predictions.decoder",
                   "deberta.embeddings.word_embeddings"),
    "modernbert": ("model.layers.0.attn", "decoder", "model.embeddings.tok_embeddings"),
}
#: column layers of one attention block (DeBERTa: q/k/v and the relative-position projections;
#: ModernBERT: one packed [q|k|v])
_COLUMNS = {"deberta-v2": 5, "modernbert": 1}


@pytest.mark.parametrize("arch", ENCODERS)
def test_encoder_plan_and_tied_mlm_head(arch):
    model = tiny_model(arch)
    model.tie_weights()
    plan = resolve_tp_plan(model, None, 2)
    attn, head, emb = _HEADS[arch]
    styles = {e.name[len(attn) + 1:]: e.style for e in plan.entries if e.name.startswith(attn + ".")}
    assert sorted(styles.values()).count("column") == _COLUMNS.get(arch, 3), styles
    assert plan.architectures == (arch.replace("-", ""),)
    if arch == "deberta-v2":  # its MLM head multiplies by the embedding weight itself: both stay whole
        assert plan[head].style == "replicate" and plan[emb].style == "replicate"
        return
    assert plan[head].style == "vocab" and plan[emb].style == "vocab"
    assert plan[head].extra.get("tied_to") == emb  # the masked-LM head stays tied to the embeddings
    if arch == "modernbert":  # heads come from view(..., 3, -1, head_dim) of the packed output
        assert plan[attn + ".Wqkv"].extra["packed_chunks"] == 3 and plan["model.layers.0.mlp.Wi"].extra["packed_chunks"] == 2
    else:
        assert any(f.module == attn for f in plan.fixups)  # local head counts


def test_albert_shares_one_layer_and_classifier_stays_whole():
    plan = resolve_tp_plan(tiny_model("albert", task="cls"), None, 2)
    layers = {e.name.split(".albert_layers.")[0] for e in plan.sharded if ".albert_layers." in e.name}
    assert layers == {"albert.encoder.albert_layer_groups.0"}
    assert plan["classifier"].style == "replicate"


def test_encoder_head_count_must_divide_tp():
    with pytest.raises(MegatronConfigError, match=r"tp=3 does not divide num_attention_heads=4 of "
                                                  r"roberta\.encoder\.layer\.0\.attention\.self"):
        resolve_tp_plan(tiny_model("roberta"), None, 3)


def test_bert_shaped_blocks_under_other_class_names_are_recognized_by_their_layout():
    """ERNIE, RoFormer, ESM, ... lay their blocks out as BERT does; the sweep found them refused
    ('no known block'). Swin's attention, with its per-head relative position bias, is left to
    structural detection."""
    from megastrategy.layers.builtin_plans import detect_builtin_plan
    from tests.helpers.tiny_configs import tiny_config
    import transformers

    ernie = transformers.ErnieForMaskedLM(tiny_config("ernie"))
    kinds = {(u.arch, u.kind) for u in detect_builtin_plan(ernie).units}
    assert kinds == {("ernie", "attention"), ("ernie", "mlp")}
    swin = transformers.SwinForImageClassification(tiny_config("swin"))
    assert {u.origin for u in detect_builtin_plan(swin).units if u.arch == "swin"} == {"structural"}
