"""Auto-detected plans for Hugging Face BERT / GPT-2 / Llama and torch Transformer layers:
resolution (pure), and equivalence with the unsharded model on real processes."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.builtin_plans import detect_builtin_plan
from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
from tests.helpers.dist import run_distributed
from tests.layers.test_plan import check_logits, check_params_and_grads, make_tracker

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB = 99  # divisible by neither 2 nor 4
SEQ = 8


# ------------------------------------------------------------------------------------ models
def bert_config(p_attn=0.0, p_hidden=0.0, heads=4, hidden=32, ffn=64):
    return BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
        intermediate_size=ffn, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=p_hidden, attention_probs_dropout_prob=p_attn,
    )


def gpt2_config(p=0.0):
    return GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
        attn_pdrop=p, resid_pdrop=p, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )


def llama_config(p=0.0, tie=False):
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=p, tie_word_embeddings=tie,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )


class EncoderClassifier(nn.Module):
    """A plain torch.nn.TransformerEncoder text classifier (embedding and head are the user's)."""

    def __init__(self, p=0.0, enable_nested_tensor=True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=p, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=enable_nested_tensor)
        self.head = nn.Linear(32, 3)

    def forward(self, ids, pad):
        h = self.encoder(self.emb(ids) * math.sqrt(32), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


class DecoderLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.dec = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(32, VOCAB)


class LitWrapper(nn.Module):
    """Stands in for a LightningModule: the HF model sits under ``model``."""

    def __init__(self, hf):
        super().__init__()
        self.model = hf


def _inputs(seed=7, batch=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0
    labels = torch.randint(0, 3, (batch,), generator=g)
    return ids, mask, labels


# ------------------------------------------------------------------------------- pure: resolve
def test_bert_classifier_plan():
    torch.manual_seed(0)
    model = LitWrapper(BertForSequenceClassification(bert_config()))
    plan = resolve_tp_plan(model, None, 2)
    s = plan.styles()
    pre = "model.bert.encoder.layer.0."
    assert s[pre + "attention.self.query"] == s[pre + "attention.self.key"] == s[pre + "attention.self.value"] == "column"
    assert s[pre + "attention.output.dense"] == "row"
    assert s[pre + "intermediate.dense"] == "column" and s[pre + "output.dense"] == "row"
    assert s["model.bert.embeddings.word_embeddings"] == "vocab"
    assert s["model.bert.pooler.dense"] == "replicate" and s["model.classifier"] == "replicate"
    assert s["model.bert.embeddings.position_embeddings"] == "replicate"
    assert plan["model.classifier"].source == "auto:bert"
    assert plan.architectures == ("bert",) and plan.auto
    assert plan[pre + "attention.self.query"].extra["input_copy"] == pre + "attention.self"
    assert "input_copy" not in plan[pre + "intermediate.dense"].extra
    fix = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    assert fix[(pre + "attention.self", "num_attention_heads")] == (4, 2)
    assert fix[(pre + "attention.self", "all_head_size")] == (32, 16)
    assert len(fix) == 4
    regions = {r.module: r for r in plan.rng_regions}
    assert regions[pre + "attention.self"].until is None
    assert regions[pre + "attention.self"].dropout_p == "dropout.p"
    assert len(plan.sharded) == 13
    assert model.model.config.num_attention_heads == 4


def test_bert_mlm_plan_records_tie_and_bias_alias():
    model = BertForMaskedLM(bert_config())
    plan = resolve_tp_plan(model, None, 4)
    head = plan["cls.predictions.decoder"]
    assert head.style == "vocab" and head.extra["tied_to"] == "bert.embeddings.word_embeddings"
    assert head.extra["bias_aliases"] == ("bias",)  # cls.predictions.bias is decoder.bias
    assert plan["cls.predictions.transform.dense"].style == "replicate"


def test_gpt2_plan():
    model = GPT2LMHeadModel(gpt2_config())
    plan = resolve_tp_plan(model, None, 2)
    c_attn = plan["transformer.h.0.attn.c_attn"]
    assert c_attn.style == "column" and c_attn.extra["packed_chunks"] == 3
    assert c_attn.extra["weight_layout"] == "in_out" and c_attn.module_type == "Conv1D"
    assert plan["transformer.h.0.attn.c_proj"].style == "row"
    assert plan["transformer.h.0.mlp.c_fc"].style == "column" and plan["transformer.h.0.mlp.c_proj"].style == "row"
    assert plan["transformer.wte"].style == "vocab" and plan["transformer.wpe"].style == "replicate"
    assert plan["lm_head"].extra["tied_to"] == "transformer.wte"
    fix = {(f.module, f.attr): (f.old, f.new) for f in plan.fixups}
    assert fix == {
        ("transformer.h.0.attn", "num_heads"): (4, 2), ("transformer.h.0.attn", "split_size"): (32, 16),
        ("transformer.h.1.attn", "num_heads"): (4, 2), ("transformer.h.1.attn", "split_size"): (32, 16),
    }
    region = plan.rng_regions[0]
    assert (region.module, region.until) == ("transformer.h.0.attn", "transformer.h.0.attn.c_proj")


def test_cross_attention_blocks():
    cfg = gpt2_config()
    cfg.add_cross_attention = True
    plan = resolve_tp_plan(GPT2LMHeadModel(cfg), None, 2)
    assert plan["transformer.h.0.crossattention.q_attn"].style == "column"
    assert plan["transformer.h.0.crossattention.c_attn"].extra["packed_chunks"] == 2  # [k|v]
    assert plan["transformer.h.0.crossattention.c_proj"].style == "row"
    assert ("transformer.h.0.crossattention", "split_size") in {(f.module, f.attr) for f in plan.fixups}
    bcfg = bert_config()
    bcfg.is_decoder, bcfg.add_cross_attention = True, True
    plan = resolve_tp_plan(transformers.BertLMHeadModel(bcfg), None, 2)
    assert plan["bert.encoder.layer.0.crossattention.self.key"].style == "column"
    assert plan["bert.encoder.layer.0.crossattention.output.dense"].style == "row"
    assert plan["cls.predictions.decoder"].extra["tied_to"] == "bert.embeddings.word_embeddings"


def test_gpt2_user_plan_keeps_builtin_knowledge_when_styles_agree():
    model = GPT2LMHeadModel(gpt2_config())
    plan = resolve_tp_plan(model, {"transformer.h.*.attn.c_attn": "column", "transformer.h.*.attn.c_proj": "row"}, 2)
    assert plan["transformer.h.0.attn.c_attn"].extra["packed_chunks"] == 3
    assert {f.attr for f in plan.fixups} == {"num_heads", "split_size"}
    assert plan["transformer.h.0.mlp.c_fc"].style == "replicate"  # used as given: not named
    assert plan["transformer.h.0.mlp.c_fc"].source == "default"
    assert not plan.auto


def test_llama_plan_tied_and_untied():
    for tie in (False, True):
        model = LlamaForCausalLM(llama_config(tie=tie))
        plan = resolve_tp_plan(model, None, 2)
        pre = "model.layers.1."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert plan[pre + n].style == "column"
        assert plan[pre + "self_attn.o_proj"].style == "row" and plan[pre + "mlp.down_proj"].style == "row"
        assert plan[pre + "mlp.gate_proj"].extra["input_copy"] == pre + "mlp"
        assert plan["model.embed_tokens"].style == "vocab" and plan["lm_head"].style == "vocab"
        assert ("tied_to" in plan["lm_head"].extra) is tie
        assert plan.fixups == ()  # transformers 5: no head-count attribute on LlamaAttention
        assert plan.rng_regions[0].dropout_p == "attention_dropout"
    at_tp4 = resolve_tp_plan(LlamaForCausalLM(llama_config()), None, 4)  # 2 key/value heads: each on 2 ranks
    assert at_tp4["model.layers.0.self_attn.k_proj"].style == "kv_whole"


@pytest.mark.parametrize("family", ["Mistral", "Qwen2", "Qwen3"])
def test_llama_family_plans(family):
    cfg_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16)
    plan = resolve_tp_plan(model_cls(cfg), None, 2)
    assert plan.architectures == (family.lower(),)
    assert plan["model.layers.0.self_attn.o_proj"].style == "row" and plan["lm_head"].style == "vocab"


def test_torch_encoder_plan():
    plan = resolve_tp_plan(EncoderClassifier(), None, 2)
    s = plan.styles()
    assert s["encoder.layers.0.self_attn"] == "attention"
    assert s["encoder.layers.0.linear1"] == "column" and s["encoder.layers.0.linear2"] == "row"
    assert s["encoder.layers.0.dropout"] == "dropout"
    assert "encoder.layers.0.dropout1" not in s  # residual dropouts act on replicated activations
    assert "encoder.layers.0.self_attn.out_proj" not in s  # replaced with the attention as a whole
    assert s["emb"] == "replicate" and s["head"] == "replicate"  # stand-alone user layers
    assert ("encoder", "use_nested_tensor") in {(f.module, f.attr) for f in plan.fixups}
    # the decoder layer: self- and cross-attention
    s = resolve_tp_plan(DecoderLM(), None, 2).styles()
    assert s["dec.self_attn"] == s["dec.multihead_attn"] == "attention" and s["dec.linear2"] == "row"
    with pytest.raises(MegatronConfigError, match=r"tp=3 does not divide num_heads=4 of encoder\.layers\.0\.self_attn"):
        resolve_tp_plan(EncoderClassifier(), None, 3)


def test_combined_form_and_replicate_override():
    model = LitWrapper(BertForSequenceClassification(bert_config()))
    plan = resolve_tp_plan(model, {"*": "auto", "model.bert.encoder.layer.1": "replicate"}, 2)
    s = plan.styles()
    assert s["model.bert.encoder.layer.0.attention.self.query"] == "column"
    assert s["model.bert.encoder.layer.1.attention.self.query"] == "replicate"
    assert not any(f.module.startswith("model.bert.encoder.layer.1") for f in plan.fixups)
    plan = resolve_tp_plan(model, {"*": "auto", "model.bert.embeddings.word_embeddings": "replicate"}, 2)
    assert plan["model.bert.embeddings.word_embeddings"].style == "replicate"


def test_builtin_block_must_be_sharded_whole():
    model = LitWrapper(BertForSequenceClassification(bert_config()))
    with pytest.raises(
        MegatronConfigError,
        match=r"tp_plan shards .*layer\.0\.attention\.self\.query.* but not .*layer\.0\.attention\.output\.dense.*"
        r"add \{'model\.bert\.encoder\.layer\.0\.attention\.output\.dense': 'row'\}.*mark 'model\.bert\.encoder\.layer\.0\.attention' 'replicate'",
    ):
        resolve_tp_plan(model, {"*": "auto", "model.bert.encoder.layer.0.attention.output": "replicate"}, 2)


def test_errors_on_builtin_models():
    # the suggestion lists the tp values that divide every constrained size (heads, hidden, FFN)
    with pytest.raises(MegatronConfigError, match=r"tp=4 does not divide num_attention_heads=6 .*use tp in \{1, 2\}"):
        resolve_tp_plan(BertForSequenceClassification(bert_config(heads=6, hidden=48)), None, 4)
    model = BertForSequenceClassification(bert_config(heads=6, hidden=48, ffn=96))
    with pytest.raises(
        MegatronConfigError,
        match=r"tp=4 does not divide num_attention_heads=6 of bert\.encoder\.layer\.0\.attention\.self .*use tp in \{1, 2, 3, 6\}",
    ):
        resolve_tp_plan(model, None, 4)
    with pytest.raises(MegatronConfigError, match=r"encoder\.layers\.0\.self_attn\.out_proj' lies inside 'encoder\.layers\.0\.self_attn'"):
        resolve_tp_plan(EncoderClassifier(), {"*": "auto", "encoder.layers.0.self_attn.out_proj": "row"}, 2)
    # a user Linear inside a repeated block next to recognized layers
    model = EncoderClassifier()
    model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32))])
    model.blocks[0].add_module("extra", nn.Sequential(nn.Linear(32, 32)))
    with pytest.raises(MegatronConfigError, match=r"recognized torch blocks but cannot classify.*'blocks\.\*\.extra\.\*'"):
        resolve_tp_plan(model, None, 2)


def test_detection_is_by_class():
    det = detect_builtin_plan(LitWrapper(GPT2LMHeadModel(gpt2_config())))
    assert det.architectures == ["gpt2"]
    assert "model" in det.recognized_roots and "model.transformer" in det.recognized_roots


# ---------------------------------------------------------------------- distributed: equivalence
def _tp_mha_rename(name: str) -> str:
    return name.replace("self_attn.in_proj.weight", "self_attn.in_proj_weight").replace(
        "self_attn.in_proj.bias", "self_attn.in_proj_bias"
    )


def _equivalence(rank, world, which):
    """Apply the auto-detected plan to a copy of each model; compare outputs, losses and the
    gradients of every parameter with the unsharded model."""
    from megastrategy.layers.embedding import VocabParallelEmbedding
    from megastrategy.layers.vocab_head import VocabParallelHead

    group = dist.group.WORLD
    ids, mask, labels = _inputs()
    report = {}
    for name in which:
        torch.manual_seed(0)
        rename, transposed = None, ()
        if name == "bert_cls":
            model = LitWrapper(BertForSequenceClassification(bert_config()))
        elif name == "bert_mlm":
            model = LitWrapper(BertForMaskedLM(bert_config()))
        elif name == "gpt2":
            model = LitWrapper(GPT2LMHeadModel(gpt2_config()))
            transposed = {n for n, p in model.named_parameters() if n.endswith("weight") and ".h." in n and p.dim() == 2}
        elif name.startswith("llama"):
            model = LitWrapper(LlamaForCausalLM(llama_config(tie=name == "llama_tied")))
        elif name == "encoder":
            model = EncoderClassifier()
            rename = _tp_mha_rename
        else:
            raise AssertionError(name)
        model.train()
        ref = copy.deepcopy(model)
        plan = resolve_tp_plan(model, None, world)
        apply_tp_plan(model, plan, group=group, rng_tracker=make_tracker(rank))
        hf = getattr(model, "model", None)

        if name == "encoder":
            out, ref_out = model(ids, mask == 0), ref(ids, mask == 0)
            torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
            loss, ref_loss = F.cross_entropy(out, labels), F.cross_entropy(ref_out, labels)
            # eval + no_grad: torch's fused fast paths must stay off
            model.eval()
            ref.eval()
            with torch.no_grad():
                torch.testing.assert_close(model(ids, mask == 0), ref(ids, mask == 0), atol=1e-5, rtol=1e-4)
            model.train()
        elif name == "bert_cls":
            att = hf.bert.encoder.layer[0].attention.self
            assert att.num_attention_heads == 4 // world and att.all_head_size == 32 // world
            assert hf.config.num_attention_heads == 4  # shared config untouched
            assert att.query.input_copy is att.key.input_copy is att.value.input_copy is not None
            out = hf(input_ids=ids, attention_mask=mask, labels=labels)
            ref_out = ref.model(input_ids=ids, attention_mask=mask, labels=labels)
            torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-4)
            loss, ref_loss = F.cross_entropy(out.logits, labels), F.cross_entropy(ref_out.logits, labels)
            torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-5)
        else:
            # Hugging Face's own tying machinery must not break or re-tie wrongly
            hf.tie_weights()
            emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
            assert isinstance(emb, VocabParallelEmbedding) and isinstance(head, VocabParallelHead)
            if name == "bert_mlm":
                assert head.weight is emb.weight
                assert hf.cls.predictions.bias is head.bias
            elif name in ("gpt2", "llama_tied"):
                assert head.weight is emb.weight
            else:
                assert head.weight is not emb.weight
            if name == "gpt2":
                attn = hf.transformer.h[0].attn
                assert attn.num_heads == 4 // world and attn.split_size == 32 // world and attn.embed_dim == 32
            kw = dict(input_ids=ids, attention_mask=mask)
            if name == "bert_mlm":
                targets = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.5, ids, -100)
                targets[0, 0] = ids[0, 0]
            else:
                targets = ids
            out, ref_out = hf(**kw, labels=targets), ref.model(**kw, labels=targets)
            assert tuple(out.logits.shape) == (2, SEQ, VOCAB)
            # the model's own loss (HF calls F.cross_entropy on the vocab-parallel logits)
            torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-5)
            assert torch.equal(out.logits.argmax(-1), ref_out.logits.argmax(-1))
            if name == "bert_mlm":
                loss, ref_loss = out.loss, ref_out.loss
            else:
                loss, ref_loss = check_logits(out.logits[:, :-1], ref_out.logits[:, :-1], ids[:, 1:], VOCAB)
        loss.backward()
        ref_loss.backward()
        report[name] = (
            len(plan.sharded),
            check_params_and_grads(model, ref, rank, world, rename=rename, transposed=transposed),
            float(loss.detach()),
        )
    return report


def _dropout_streams(rank, world):
    """Dropout on sharded activations draws from the per-TP-rank stream; dropout on replicated
    activations from the default stream (identical over TP ranks): the outputs must agree."""
    group = dist.group.WORLD
    ids, mask, labels = _inputs()
    report = {}
    for name in ("bert", "gpt2", "llama", "encoder"):
        torch.manual_seed(0)
        if name == "bert":
            model = BertForSequenceClassification(bert_config(p_attn=0.5))
            run = lambda: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
        elif name == "gpt2":
            model = GPT2LMHeadModel(gpt2_config(p=0.5))
            run = lambda: model.transformer(input_ids=ids).last_hidden_state  # noqa: E731
        elif name == "llama":
            model = LlamaForCausalLM(llama_config(p=0.5))
            run = lambda: model.model(input_ids=ids).last_hidden_state  # noqa: E731
        else:
            model = EncoderClassifier(p=0.5)
            run = lambda: model(ids, mask == 0)  # noqa: E731
        model.train()
        tracker = make_tracker(rank)
        apply_tp_plan(model, resolve_tp_plan(model, None, world), group=group, rng_tracker=tracker)
        torch.manual_seed(42)  # the default stream: the same on every TP rank
        before_default, before_tracker = torch.get_rng_state(), tracker.get_state()["model_parallel_rng_state"]
        out = run()
        default_moved = not torch.equal(before_default, torch.get_rng_state())
        tracker_moved = not torch.equal(before_tracker, tracker.get_state()["model_parallel_rng_state"])
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out.detach().contiguous())
        same = all(torch.equal(gathered[0], g) for g in gathered)
        assert not tracker._forked  # every region was left
        model.eval()
        eval_state = tracker.get_state()["model_parallel_rng_state"]
        run()
        eval_untouched = torch.equal(eval_state, tracker.get_state()["model_parallel_rng_state"])
        report[name] = (default_moved, tracker_moved, same, eval_untouched)
    return report


def _equivalence_and_dropout(rank, world, which):
    return _equivalence(rank, world, which), _dropout_streams(rank, world)


def test_equivalence_and_dropout_streams_tp2():
    which = ["bert_cls", "bert_mlm", "gpt2", "llama", "llama_tied", "encoder"]
    results = run_distributed(_equivalence_and_dropout, 2, which)
    reports = [r[0] for r in results]
    for name in which:
        n_sharded, n_params, loss = reports[0][name]
        assert n_sharded > 0 and n_params > 0
        assert reports[1][name][:2] == (n_sharded, n_params)
        assert reports[0][name][2] == pytest.approx(reports[1][name][2])
    # (default stream moved, per-TP-rank stream moved, outputs equal over TP ranks, eval untouched)
    rep = results[0][1]
    # BERT / Llama: attention dropout is the only dropout -> the default stream is untouched
    assert rep["bert"] == (False, True, True, True)
    assert rep["llama"] == (False, True, True, True)
    # GPT-2 (resid dropout after c_proj) and the torch encoder (dropout1/2) also drop
    # replicated activations, on the default stream, identically on every TP rank
    assert rep["gpt2"] == (True, True, True, True)
    assert rep["encoder"] == (True, True, True, True)


def test_equivalence_bert_tp4():
    reports = run_distributed(_equivalence, 4, ["bert_cls", "bert_mlm"])
    assert all(r["bert_mlm"][0] == 14 and r["bert_cls"][0] == 13 for r in reports)
