"""MegatronStrategy(cp=...) against Lightning's DDPStrategy on the same unchanged modules.

Real gloo processes; every world size is one launch that trains each case in turn
(tests/scripts/train_cp.py), and each DDP reference runs once. Per-step train losses and the
validation loss must agree within 2e-4 (fp32, dropout off); all_gather at validation epoch end
must see each example once (cp ranks are not replicas), a torchmetrics metric must equal DDP's,
and the ring must have carried bytes (the sequence really was split). A run saved halfway and
resumed in a new Trainer must continue exactly.
"""
import json
from pathlib import Path

import pytest

from megastrategy import MegatronStrategy
from megastrategy.all_components import ContextParallelComponent
from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.parallel_state import ParallelLayout
from tests.helpers.launch import run_script
from tests.helpers.models import EncoderClassifier, LlamaLM

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_cp.py"
TOL = 2e-4
LLAMA, NOPAD, BERT = "llama", {"pad": False}, "bert-metrics"


def _case(name, model=LLAMA, strategy="megatron", model_kwargs=None, trainer=None, expect_error=False, resume=False,
          recompute=None, **kwargs):
    return {"name": name, "model": model, "strategy": strategy, "kwargs": kwargs, "model_kwargs": model_kwargs or {},
            "trainer": trainer or {}, "expect_error": expect_error, "resume": resume, "recompute": recompute}


# SGD feels the gradient's scale (Adam does not): a norm counted once per cp rank would show
CLIP = {"model_kwargs": {"optimizer": "sgd"}, "trainer": {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}}


LAUNCHES = {
    1: [_case("ddp", strategy="ddp"), _case("ddp_nopad", strategy="ddp", model_kwargs=NOPAD),
        _case("ddp_bert", model=BERT, strategy="ddp"), _case("ddp_clip", strategy="ddp", **CLIP),
        _case("ddp_noclip", strategy="ddp", model_kwargs=CLIP["model_kwargs"], trainer={"accumulate_grad_batches": 2})],
    2: [_case("ddp_dp2", strategy="ddp"), _case("cp2", cp=2), _case("cp2_distopt", cp=2, use_distributed_optimizer=True),
        _case("cp2_bert", model=BERT, cp=2),
        _case("cp2_clip_accumulate", cp=2, **CLIP),
        _case("cp2_distopt_resumed", cp=2, use_distributed_optimizer=True, resume=True),  # saved halfway, resumed
        # activation recompute, every form (the user's recompute: tests/context/checkpointed_models.py)
        _case("cp2_full", cp=2, activation_checkpointing="full"),
        _case("cp2_selective", cp=2, activation_checkpointing="selective"),
        _case("cp2_hf", cp=2, recompute="hf"), _case("cp2_user", cp=2, recompute="user"),
        _case("cp2_user_reentrant", cp=2, recompute="user_reentrant"),
        _case("balanced_seq14", cp=2, model_kwargs={"seq": 14}, expect_error=True),
        _case("contiguous_seq15", cp=2, cp_layout="contiguous", model_kwargs={"seq": 15}, expect_error=True)],
    4: [_case("cp4", cp=4), _case("tp2cp2", tp=2, cp=2), _case("tp2cp2_sp", tp=2, cp=2, sequence_parallel=True),
        _case("cp2pp2", cp=2, pp=2, model_kwargs=NOPAD), _case("dp2cp2", cp=2),
        _case("tp2cp2_full", tp=2, cp=2, activation_checkpointing="full"),
        _case("cp2pp2_full", cp=2, pp=2, model_kwargs=NOPAD, activation_checkpointing="full"),
        _case("cp2pp2_hf", cp=2, pp=2, model_kwargs=NOPAD, recompute="hf"),
        # the stage's hooks sit on the user's wrapper, the checkpoint inside it: replayed at cp2 under pp
        _case("cp2pp2_user_reentrant", cp=2, pp=2, model_kwargs=NOPAD, recompute="user_reentrant")],
}
# (case, its world size, the DDP reference, the reference's world size)
EQUIVALENT = [
    ("cp2", 2, "ddp", 1), ("cp4", 4, "ddp", 1), ("tp2cp2", 4, "ddp", 1), ("tp2cp2_sp", 4, "ddp", 1),
    # pipelining averages per-microbatch token means: no padding, so that equals DDP's one mean
    ("cp2pp2", 4, "ddp_nopad", 1), ("dp2cp2", 4, "ddp_dp2", 2), ("cp2_distopt", 2, "ddp", 1),
    ("cp2_bert", 2, "ddp_bert", 1), ("cp2_distopt_resumed", 2, "ddp", 1),
    ("cp2_clip_accumulate", 2, "ddp_clip", 1),
    ("cp2_full", 2, "ddp", 1), ("cp2_selective", 2, "ddp", 1), ("cp2_hf", 2, "ddp", 1), ("cp2_user", 2, "ddp", 1),
    ("cp2_user_reentrant", 2, "ddp", 1), ("tp2cp2_full", 4, "ddp", 1), ("cp2pp2_full", 4, "ddp_nopad", 1),
    ("cp2pp2_hf", 4, "ddp_nopad", 1), ("cp2pp2_user_reentrant", 4, "ddp_nopad", 1),
]
# (recomputing case, its world size, the same layout without recompute, whether whole blocks are recomputed)
RECOMPUTED = [
    ("cp2_full", 2, "cp2", True), ("cp2_selective", 2, "cp2", False), ("cp2_hf", 2, "cp2", True),
    ("cp2_user", 2, "cp2", True), ("cp2_user_reentrant", 2, "cp2", True), ("tp2cp2_full", 4, "tp2cp2", True),
    ("cp2pp2_full", 4, "cp2pp2", True), ("cp2pp2_hf", 4, "cp2pp2", True), ("cp2pp2_user_reentrant", 4, "cp2pp2", True),
]


def _launch(nprocs: int) -> dict:
    return run_script(SCRIPT, nprocs, ["--cases", json.dumps(LAUNCHES[nprocs])], timeout=800)


@pytest.mark.slow
@pytest.mark.parametrize("name, nprocs, ref_name, ref_nprocs", EQUIVALENT, ids=[e[0] for e in EQUIVALENT])
@pytest.mark.timeout(900)
def test_cp_trains_as_ddp(name, nprocs, ref_name, ref_nprocs):
    ours, ref = _launch(nprocs)[name], _launch(ref_nprocs)[ref_name]
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 0
    diffs = [abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"])]
    assert max(diffs) < TOL, f"{name}: per-step losses differ by {max(diffs):.2e}: {ours['train_loss']} vs {ref['train_loss']}"
    assert ref["train_loss"][0] != ref["train_loss"][-1], "the reference did not train"
    assert len(ours["val_loss"]) == len(ref["val_loss"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["val_loss"], ref["val_loss"])) < TOL
    assert ours["gathered"] == ref["gathered"], "all_gather must see each example once, as under DDP"
    assert ours["ring_bytes"] > 0, "the ring carried nothing: the sequence was not split"
    for key in ("val_acc", "train_acc_epoch"):  # torchmetrics synced over replicas, not cp ranks
        if key in ref["metrics"]:
            assert ours["metrics"][key] == pytest.approx(ref["metrics"][key], abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("name, nprocs, plain, blocks", RECOMPUTED, ids=[r[0] for r in RECOMPUTED])
@pytest.mark.timeout(900)
def test_recompute_really_replays_under_the_ring(name, nprocs, plain, blocks):
    """Attention modules run again in backward (not with selective, which recomputes only the attention
    function), and the ring carries one more forward's K/V: forward 1 unit, backward 3 (K/V and both
    gradients), so 5/4 of the bytes without recompute. (Under pp the stage's probing forwards, unsplit and
    never replayed, also count as calls.)"""
    ours, base = _launch(nprocs)[name], _launch(nprocs)[plain]
    calls = (ours["attention_calls"], base["attention_calls"])
    assert calls[0] > calls[1] > 0 if blocks else calls[0] == calls[1] > 0, calls
    assert 4 * ours["ring_bytes"] == 5 * base["ring_bytes"] > 0, (ours["ring_bytes"], base["ring_bytes"])
    if nprocs == 2:  # every training forward is split there: each one replayed once
        assert calls[0] == (2 if blocks else 1) * calls[1], calls


@pytest.mark.slow
def test_the_clipping_case_really_clips():
    runs = _launch(1)
    assert max(abs(a - b) for a, b in zip(runs["ddp_clip"]["train_loss"], runs["ddp_noclip"]["train_loss"])) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name, multiple", [("balanced_seq14", "4 (2·cp"), ("contiguous_seq15", "2 (cp")])
def test_a_sequence_length_cp_cannot_split_evenly_is_refused(name, multiple):
    error = _launch(2)[name]["error"]
    assert error.startswith("MegatronConfigError") and f"not divisible by {multiple}" in error and "Pad" in error


def _layout(cp: int) -> ParallelLayout:
    return ParallelLayout(world_size=cp, tp=1, pp=1, cp=cp, ep=1, etp=1, vp=None, order=MegatronConfig().order)


def test_a_model_cp_cannot_run_exactly_is_refused_before_any_group():
    part = ContextParallelComponent(MegatronConfig(cp=2))
    with pytest.raises(MegatronConfigError, match="nn.MultiheadAttention"):
        part.validate(EncoderClassifier(), _layout(2))
    part.validate(LlamaLM(), _layout(2))  # a model it can run passes


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_with_cp_is_accepted_in_the_constructor(mode):
    assert MegatronStrategy(cp=2, activation_checkpointing=mode).component(ContextParallelComponent) is not None


def test_the_component_is_in_the_strategy_only_when_cp_is_above_one():
    assert MegatronStrategy(cp=2).component(ContextParallelComponent) is not None
    assert MegatronStrategy(cp=1).component(ContextParallelComponent) is None
    assert MegatronConfig(cp=2).should_broadcast_batch  # every cp rank must see the same batch
