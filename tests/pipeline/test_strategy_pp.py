"""Pipeline parallelism inside Lightning's loop: per-step train_loss and val_loss on rank 0 must
match Lightning's own DDPStrategy on the data-parallel process count, from the same seed."""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "train.py"
TOL = 2e-4
pytestmark = pytest.mark.slow

LAYOUTS = {  # name: (processes, dp, strategy arguments)
    "pp2": (2, 1, ("--pp", "2")),
    "tp2-pp2": (4, 1, ("--tp", "2", "--pp", "2")),
    "pp2-vp2": (2, 1, ("--pp", "2", "--vp", "2")),
    "pp4": (4, 1, ("--pp", "4")),
    "tp2-pp2-dp2": (8, 2, ("--tp", "2", "--pp", "2")),
}


@lru_cache(maxsize=None)
def _run(strategy: str, nprocs: int, model: str, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--model", model, "--strategy", strategy, "--layers", "4", *extra], timeout=400)


def _assert_same(ours: dict, ref: dict) -> None:
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 0
    diff = max(abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"]))
    assert diff < TOL, f"train_loss differs by {diff:.2e}: {ours['train_loss']} vs {ref['train_loss']}"
    assert len(ours["val_loss"]) == len(ref["val_loss"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["val_loss"], ref["val_loss"])) < TOL


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model, plan", [("bert", ()), ("gpt", ("--user-plan",))], ids=["hf-bert", "gpt-tied"])
def test_pipeline_layout_matches_ddp(model, plan, layout):
    nprocs, dp, extra = LAYOUTS[layout]
    _assert_same(_run("megatron", nprocs, model, *extra, *plan), _run("ddp", dp, model))


UNEVEN = {  # name: (model, processes, arguments of both runs, strategy arguments)
    "bert-3-layers-pp2": ("bert", 2, ("--layers", "3"), ("--pp", "2")),  # 2 + 1
    "gpt-tied-5-layers-pp2-vp2": ("gpt", 2, ("--layers", "5"), ("--pp", "2", "--vp", "2", "--user-plan")),  # 2, 1, 1, 1
    "gpt-tied-named-3-1": ("gpt", 2, (), ("--pp", "2", "--stage-layers", "3,1", "--user-plan")),
}


@pytest.mark.parametrize("case", sorted(UNEVEN))
def test_stages_of_unequal_layer_counts_match_ddp(case):
    """Layer counts pp·vp does not divide, split automatically or named: where a block runs never
    changes what it computes (the tied embedding's two uses included)."""
    model, nprocs, both, extra = UNEVEN[case]
    _assert_same(_run("megatron", nprocs, model, *both, *extra), _run("ddp", 1, model, *both))


ZERO_BUBBLE = {  # name: (model, processes, dp, strategy arguments); ZB-H1 with each model, with TP, and at pp=4
    "bert-pp2": ("bert", 2, 1, ("--pp", "2", "--pipeline-schedule", "zb_h1")),
    "bert-tp2-pp2": ("bert", 4, 1, ("--tp", "2", "--pp", "2", "--pipeline-schedule", "zb_h1")),
    "gpt-pp4": ("gpt", 4, 1, ("--pp", "4", "--pipeline-schedule", "zb_h1", "--user-plan")),
}


ZB_V = {  # name: (model, processes, extra arguments of both runs, strategy arguments); loss on pp rank 0
    "bert-pp2": ("bert", 2, ("--batch-size", "4"), ("--pp", "2", "--num-microbatches", "4")),
    "gpt-pp2": ("gpt", 2, ("--batch-size", "4"), ("--pp", "2", "--num-microbatches", "4", "--user-plan")),
    "gpt-pp4": ("gpt", 4, ("--batch-size", "8", "--layers", "8"), ("--pp", "4", "--num-microbatches", "8", "--user-plan")),
    "bert-tp2-pp2": ("bert", 4, ("--batch-size", "4"), ("--tp", "2", "--pp", "2", "--num-microbatches", "4")),
}


@pytest.mark.parametrize("case", sorted(ZB_V))
def test_zb_v_matches_ddp(case):
    """ZB-V: two chunks per rank in a V, the head, the loss and the tied embedding's both uses on rank 0."""
    model, nprocs, both, extra = ZB_V[case]
    _assert_same(_run("megatron", nprocs, model, "--pipeline-schedule", "zb_v", *both, *extra), _run("ddp", 1, model, *both))


@pytest.mark.parametrize("case", sorted(ZERO_BUBBLE))
def test_zero_bubble_schedule_matches_ddp(case):
    """TP's backward collectives run in B (they are on the input-gradient path) on every TP rank alike."""
    model, nprocs, dp, extra = ZERO_BUBBLE[case]
    _assert_same(_run("megatron", nprocs, model, *extra), _run("ddp", dp, model))


def test_zero_bubble_with_overlapped_dp_reduction_matches_ddp():
    """The DP buffer's per-parameter hooks fire in the deferred W steps; each bucket starts its
    all-reduce once the last W of the step has filled it."""
    extra = ("--pp", "2", "--pipeline-schedule", "zb_h1", "--overlap-grad-reduce", "--user-plan", "--bucket-numel", "2000")
    ours = _run("megatron", 4, "gpt", *extra)
    _assert_same(ours, _run("ddp", 2, "gpt"))
    assert ours["early_bucket_starts"] > 0  # rank 0's buckets started during its W steps


def test_clip_and_accumulation_under_tp_pp_use_the_global_norm():
    extra = ("--clip", "0.05", "--accumulate", "2", "--optimizer", "sgd")
    _assert_same(_run("megatron", 4, "gpt", "--tp", "2", "--pp", "2", "--user-plan", *extra), _run("ddp", 1, "gpt", *extra))


def test_logging_surface_under_tp_pp_matches_ddp(tmp_path):
    """torchmetrics objects, prog_bar, log_dict, the sanity check, ModelCheckpoint(monitor) and
    EarlyStopping all see on rank 0 (first stage) what single-device training shows."""
    args = ["--model", "bert-metrics", "--layers", "4", "--steps", "4"]
    ours = run_script(SCRIPT, 4, args + ["--strategy", "megatron", "--tp", "2", "--pp", "2", "--callbacks", str(tmp_path / "a")], timeout=400)
    ref = run_script(SCRIPT, 1, args + ["--strategy", "ddp", "--callbacks", str(tmp_path / "b")], timeout=400)
    assert max(abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"])) < TOL
    for mine, theirs in zip(ours["metrics"], ref["metrics"]):
        assert mine.keys() == theirs.keys() and {"train_acc_step", "logit_mean", "train_loss"} <= mine.keys()
        assert all(abs(mine[k] - theirs[k]) < TOL for k in mine), (mine, theirs)
    assert ours["progress"][-1].keys() == ref["progress"][-1].keys()
    assert abs(ours["best_model_score"] - ref["best_model_score"]) < TOL
    final, final_ref = ours["final_metrics"], ref["final_metrics"]
    assert final.keys() == final_ref.keys() and {"val_acc", "train_acc_epoch", "val_loss"} <= final.keys()
    assert all(abs(final[k] - final_ref[k]) < TOL for k in final), (final, final_ref)


@pytest.mark.parametrize("layout", ["pp2", "pp2-vp2"])
def test_a_frozen_tied_embedding_stays_frozen_like_ddps(layout):
    """Fine-tuning habit: ``wte.requires_grad_(False)`` on a GPT whose head is tied to it. The copies
    on the first and last stage have no gradient to sum; DDP trains the rest the same way."""
    nprocs, dp, extra = LAYOUTS[layout]
    _assert_same(_run("megatron", nprocs, "gpt", *extra, "--user-plan", "--freeze", "wte"),
                 _run("ddp", dp, "gpt", "--freeze", "wte"))


RAGGED = ("--n-train", "30", "--batch-size", "8", "--epochs", "1", "--steps", "4")  # batches of 8, 8, 8 and a last one of 6
RAGGED_SCHEDULES = {  # name: strategy arguments; num_microbatches=4 does not divide the last batch
    "1f1b": ("--pp", "2", "--num-microbatches", "4"),
    "interleaved": ("--pp", "2", "--vp", "2", "--num-microbatches", "4"),
    "zb_h1": ("--pp", "2", "--num-microbatches", "4", "--pipeline-schedule", "zb_h1"),
    "zb_v": ("--pp", "2", "--num-microbatches", "4", "--pipeline-schedule", "zb_v"),
}


@pytest.mark.parametrize("schedule", sorted(RAGGED_SCHEDULES))
def test_an_epochs_ragged_last_batch_trains_like_ddp(schedule):
    """``DataLoader(drop_last=False)``, Lightning's default, ends an epoch with a smaller batch: it
    runs as fewer equal microbatches (3, or 2 where the schedule needs a multiple of pp), not as an
    error at the end of the epoch."""
    ours = _run("megatron", 2, "bert", *RAGGED, *RAGGED_SCHEDULES[schedule])
    ref = _run("ddp", 1, "bert", *RAGGED)
    assert len(ref["train_loss"]) == 4
    _assert_same(ours, ref)
