"""The Hugging Face test matrix: tp=2, and pp=2 for the tasks and architectures beyond the
pipeline zoo (tests/pipeline/test_hf_stages.py), on two processes against one device
(DDPStrategy on one process, same seed); every model trained a few steps in one launch per side.

Per-step training losses and the validation loss must agree within 2e-4 for every model whose
plan the strategy accepts; a model it refuses must be refused in setup with the expected reason,
and the launch goes on with the next model (the block check's refusals are also tested in
test_block_check.py). Set ``HF_MATRIX_JSON=path`` to keep the results;
``tests/scripts/render_hf_matrix.py`` turns them into the README table.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.hf_zoo import BUILTIN_DECODERS, DECLARED_DECODERS, ENCODERS, STRUCTURAL_DECODERS
from tests.helpers.launch import run_script

#: encoder-decoders sharded by structural detection
STRUCTURAL_SEQ2SEQ = ("bart", "t5")
#: tasks and architectures beyond causal/masked LM and sequence classification: model -> plan source
MORE = {
    "vit:img": "structural:", "deit:img": "structural:", "convnext:img": "structural:",
    "wav2vec2:audio": "structural:", "wav2vec2:ctc": "structural:",
    "gptj:lm": "declared:", "codegen:lm": "declared:",
    "gemma3_text:lm": "declared:", "qwen2_moe:lm": "declared:", "llama-tied:lm": "declared:",
    "bert:tok": "auto:", "bert:qa": "auto:", "bert:mc": "auto:",
    "mpt:lm": "structural:",  # ALiBi [heads, q, k] handed to every block: each rank reads its heads
    "bloom:lm": "structural:",  # ALiBi [batch * heads, 1, k], likewise
    # multi-query c_attn split into (embed_dim, kv_dim, kv_dim): query heads split, the key/value head whole
    "gpt_bigcode:lm": "structural:",
}
#: 2025-2026 decoders, trained at tp2 and pp2 like MORE (they declare plans): DeepSeek-V3 (latent attention,
#: shared experts, a dense first layer), GPT-OSS (sinks, sliding/full layers: at pp each stage must use its
#: blocks' own masks), Qwen3-Next/Qwen3.5 (gated DeltaNet between full attention), NemotronH (Mamba2 + attention),
#: LFM2 (short convolutions), GLM4-MoE, Ernie4.5(-MoE), Ministral3, OLMo3, Llama 4 (chunked attention, no-rope
#: layers; its experts, declared 'packed_rowwise' on bare 3-D parameters, stay whole under tp like fused ones)
MORE.update({f"{a}:lm": "declared:" for a in (
    "deepseek_v3", "gpt_oss", "llama4_text", "qwen3_next", "qwen3_5_text", "nemotron_h", "lfm2", "glm4_moe", "ernie4_5_moe",
    "ernie4_5", "ministral3", "olmo3")})
#: from the causal-LM sweep (tests/scripts/hf_sweep.py; ``generic.`` = the config class defaults, shrunk):
#: Llama 4 with rope layers past the pipeline cut (stage 1 computed its rotary table on meta: its forward
#: moves the ids to embed_tokens.weight.device); Gemma 3 with its vision tower (pp cut the tower, not the
#: language model); BartForCausalLM (the dry run needs eager attention on meta); XGLM (its attention reshapes
#: with self.embed_dim); OPT and BioGPT, which only structural detection shards
MORE.update({"generic.llama4_text:lm": "declared:", "generic.gemma3:lm": "declared:", "generic.bart:lm": "structural:",
             "generic.xglm:lm": "structural:", "generic.opt:lm": "structural:", "generic.biogpt:lm": "structural:"})
#: refused at pp=2, trained at tp=2: XLM's layers live in parallel lists (attentions, ffns, ...) its forward indexes;
#: at tp2 its attention takes a cache= argument the block check's replay must drop
SWEPT_TP2_ONLY = {"generic.xlm:lm": "structural:"}
#: refused in setup at tp=2 (the launch goes on): model -> what the message must say
REFUSED_TP2 = {
    "mamba2:lm": "cannot tell how the packed projection",  # in_proj packs z, x|B|C and dt
}
#: refused in setup at pp=2
REFUSED_PP2 = {
    "swin:img": "input_dimensions=(4, 4)",  # the loop halves it after each downsampling stage
    "jamba:lm": "pass pipeline_layers='model.model.layers'",  # Mamba and attention layers: different classes
    "generic.xlm:lm": "spread over parallel lists",
}
#: key/value layouts trained at tp=2 only (their blocks cut at pp like the defaults'): GPT-BigCode with a
#: key/value head per query head ([heads, q|k|v]), Falcon-7B's multi-query layout ([q heads + k + v, head_dim]),
#: Llama and Gemma with one key/value head (Gemma-2B: the declared colwise k_proj/v_proj stay whole, kv_whole)
KV_LAYOUTS_TP2 = {"gpt_bigcode-mha:lm": "structural:", "falcon-mqa:lm": "structural:", "llama-mqa:lm": "declared:",
                  "gemma-mqa:lm": "declared:"}
#: trained at tp=2 only (Jamba and XLM are refused at pp=2): model -> plan source
TP2_ONLY = {"jamba:lm": "declared:", **SWEPT_TP2_ONLY, **KV_LAYOUTS_TP2}
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_matrix.py"
MODELS = (
    [f"{a}:lm" for a in DECLARED_DECODERS + BUILTIN_DECODERS + STRUCTURAL_DECODERS]
    + [f"{a}:mlm" for a in ENCODERS]
    + ["roberta:cls", "distilbert:cls", "albert:cls", "deberta-v2:cls", "modernbert:cls", "llama:cls"]
    + [f"{a}:s2s" for a in STRUCTURAL_SEQ2SEQ]
    + ["whisper:asr", "swin:img"] + list(MORE) + list(TP2_ONLY)
)
#: refused at tp=2, trained at pp=2: model -> plan source (computed at tp=1 too; "" for none: Mamba2 has no plan)
PP2_ONLY = {"mamba2:lm": ""}
PP2_MODELS = list(MORE) + list(PP2_ONLY)
TOL = 2e-4


def _run(strategy: str, nprocs: int, models: list[str], *extra: str) -> dict:
    args = ["--strategy", strategy, "--models", ",".join(models), *extra]
    return run_script(SCRIPT, nprocs, args, timeout=900)


def _reference() -> dict:
    # find_unused: Gemma 3's vision tower and BartForCausalLM's cross-attention get no gradient from a text batch
    ref = _run("ddp", 1, MODELS + [m for m in PP2_MODELS if m not in MODELS], "--find-unused")
    assert all("error" not in r for r in ref.values()), {k: v for k, v in ref.items() if "error" in v}
    return ref


def _expected_source(model: str) -> str:
    arch = model.split(":")[0]
    if model in MORE or model in PP2_ONLY or model in TP2_ONLY:
        return {**MORE, **PP2_ONLY, **TP2_ONLY}[model]
    structural = arch in STRUCTURAL_DECODERS + STRUCTURAL_SEQ2SEQ + ("whisper", "swin")
    return "declared:" if arch in DECLARED_DECODERS else "structural:" if structural else "auto:"


def _worst_differences(got: dict, ref: dict, models: list[str]) -> dict:
    worst = {}
    for model in models:
        assert "error" not in got[model], (model, got[model]["error"])
        assert len(got[model]["loss"]) == len(ref[model]["loss"]) == 3
        pairs = zip(got[model]["loss"] + [got[model]["val_loss"]], ref[model]["loss"] + [ref[model]["val_loss"]])
        worst[model] = max(abs(a - b) for a, b in pairs)
        sources, expected = got[model]["sources"], _expected_source(model)
        assert (sources or not expected) and all(s.startswith(expected) for s in sources), (model, sources)
    return worst


def _assert_refused(got: dict, refused: dict) -> None:
    """Each model refused for ``reason``, in setup: no training batch had started."""
    for model, reason in refused.items():
        assert reason in got[model].get("error", ""), (model, got[model])
        assert got[model].get("batches_started") == 0, (model, got[model])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the reference and tp2 launches of every model (the launch's own limit is 900 s each)
def test_tp2_matches_one_device_for_every_model():
    ref, tp2 = _reference(), _run("megatron", 2, MODELS + list(REFUSED_TP2), "--tp", "2")
    if os.environ.get("HF_MATRIX_JSON"):
        Path(os.environ["HF_MATRIX_JSON"]).write_text(json.dumps({"ddp": ref, "tp2": tp2}, indent=1))
    worst = _worst_differences(tp2, ref, MODELS)
    bad = {m: w for m, w in worst.items() if not w <= TOL}
    assert not bad, f"tp=2 differs from one device beyond {TOL}: {bad}"
    _assert_refused(tp2, REFUSED_TP2)
    assert len(worst) >= 12 + len(ENCODERS) + len(BUILTIN_DECODERS) + len(STRUCTURAL_DECODERS) + len(STRUCTURAL_SEQ2SEQ)


@pytest.mark.slow
def test_pp2_matches_one_device_for_more_tasks_and_architectures():
    ref, pp2 = _reference(), _run("megatron", 2, PP2_MODELS + list(REFUSED_PP2), "--pp", "2")
    if os.environ.get("HF_MATRIX_JSON"):
        path = Path(os.environ["HF_MATRIX_JSON"]).with_suffix(".pp2.json")
        path.write_text(json.dumps({"ddp": ref, "pp2": pp2}, indent=1))
    worst = _worst_differences(pp2, ref, PP2_MODELS)
    bad = {m: w for m, w in worst.items() if not w <= TOL}
    assert not bad, f"pp=2 differs from one device beyond {TOL}: {bad}"
    _assert_refused(pp2, REFUSED_PP2)


# ------------------------------------------------------------------ architectures found by the sweep
#: built by the generic tiny-config builder of tests/scripts/hf_sweep_tasks.py (the offline sweep over
#: every encoder/classifier/vision/seq2seq architecture, docs/sweeps/encoders_tp_pp.md): what the sweep fixed,
#: and a few representative architectures it found passing. model -> plan source at tp=2
SWEEP_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_sweep_tasks.py"
SWEEP_TP2 = {
    "flaubert:cls": "structural:",  # the block check handed the capture run's growing 'cache' to each call
    "nomic_bert:cls": "structural:", "eurobert:mlm": "declared:", "swinv2:img": "structural:",
    "glmasr:s2s": "declared:",
    # BERT-shaped blocks under other class names, recognized by their layout (were refused: no known block)
    "ernie:mlm": "auto:", "esm:cls": "auto:", "roformer:mlm": "auto:", "megatron-bert:mlm": "auto:",
    # were refused (no known block): BERT's layout with the row layer in a sibling module (Data2Vec-vision,
    # FNet), CLIP's towers traced on images sized by vision_config (and its dual encoder's contrastive loss),
    # DeBERTa v1's packed in_proj with per-head q_bias/v_bias, attentions that cannot run on local heads
    # left whole with their MLPs sharded (Longformer, ConvBERT)
    "data2vec-vision:img": "structural:", "fnet:mlm": "structural:", "clip:dual": "structural:",
    "siglip:img": "", "deberta:mlm": "structural:", "longformer:cls": "structural:", "convbert:cls": "structural:",
    "mobilevit:img": "structural:", "siglip2:patches": "",  # SigLIP2: images as patches with their grid
    # was refused (its attention's forward cannot run on the local heads): that attention is kept whole
    # by the block fallback, the rest sharded
    "fsmt:s2s": "structural:",
}
#: refused in setup at tp=2: layers auto-detection cannot classify (Perceiver's latent cross-attention)
SWEEP_REFUSED_TP2 = {"perceiver:cls": "recognized no known block"}
#: trained at pp=2: audio LMs whose text model declares the pp plan (the audio tower's layers were cut
#: and the step crashed in get_input_embeddings), and encoders the matrix above does not train at pp=2
SWEEP_PP2 = ["voxtral:s2s", "qwen2_audio:s2s", "modernbert:cls", "yoso:cls",
             "nomic_bert:cls"]  # its pooler was placed by registration (a strict config stopped the dry run)
#: refused in setup at pp=2 (were: silently different losses; an IndexError in the first step)
SWEEP_REFUSED_PP2 = {
    "resnet:img": "(BatchNorm2d) normalizes with the mean and variance of the batch",
    "flaubert:cls": "spread over parallel lists",
    # were refused only in the first step: every layer reads a value computed before the stack (MPNet's
    # relative position bias), the head reads one (Canine's projection), a module before the stack cannot
    # run on the meta device (I-BERT's quantized embeddings); now in setup (stand_in_probe.py)
    "mpnet:mlm": "model.mpnet.encoder.layer.1 (on its inputs) uses a value computed by",
    "canine:cls": "model.canine.projection (on its inputs) uses a value computed by",
    "ibert:cls": "(IBertEmbeddings) runs before the pipeline layer stack",
}


def _sweep(strategy: str, nprocs: int, models, *extra: str) -> dict:
    args = ["--worker", "--strategy", strategy, "--models", ",".join(models), *extra]
    return run_script(SWEEP_SCRIPT, nprocs, args, timeout=600)


def _sweep_worst(got: dict, ref: dict, expected: dict) -> dict:
    worst = {}
    for model, source in expected.items():
        assert "loss" in got[model] and len(got[model]["loss"]) == len(ref[model]["loss"]) == 3, (model, got[model])
        pairs = zip(got[model]["loss"] + [got[model]["val_loss"]], ref[model]["loss"] + [ref[model]["val_loss"]])
        worst[model] = max(abs(a - b) for a, b in pairs)
        assert all(s.startswith(source) for s in got[model]["sources"]), (model, got[model]["sources"])
    return worst


@pytest.mark.slow
def test_architectures_found_by_the_sweep_match_one_device_or_are_refused_in_setup():
    trained = list(dict.fromkeys([*SWEEP_TP2, *SWEEP_PP2]))
    ref = _sweep("ddp", 1, trained)
    assert all("loss" in ref[m] for m in trained), {m: r for m, r in ref.items() if "loss" not in r}
    tp2 = _sweep("megatron", 2, [*SWEEP_TP2, *SWEEP_REFUSED_TP2], "--tp", "2")
    pp2 = _sweep("megatron", 2, [*SWEEP_PP2, *SWEEP_REFUSED_PP2], "--pp", "2")
    worst = {**_sweep_worst(tp2, ref, SWEEP_TP2), **{f"{m} pp2": w for m, w in _sweep_worst(
        pp2, ref, dict.fromkeys(SWEEP_PP2, "")).items()}}
    bad = {m: w for m, w in worst.items() if not w <= TOL}
    assert not bad, f"differs from one device beyond {TOL}: {bad}"
    _assert_refused(tp2, SWEEP_REFUSED_TP2)
    _assert_refused(pp2, SWEEP_REFUSED_PP2)
