"""The distributed optimizer and overlapped gradient reduction under Lightning, real processes.

Each run trains the same unchanged LightningModule from the same seed (fp32, no dropout); rank 0's
per-step train_loss must agree with Lightning's own DDPStrategy on as many data-parallel
replicas within 2e-4 (see tests/test_strategy_tp.py).
"""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
TOL = 2e-4
ZERO = ("--distributed-optimizer",)
OVERLAP = ("--overlap-grad-reduce",)
SMALL_BUCKETS = ("--bucket-numel", "5000")  # several buckets, parameters cut by shard boundaries
SGD_CLIP = ("--optimizer", "sgd", "--clip", "0.05", "--accumulate", "2")
pytestmark = pytest.mark.slow


@lru_cache(maxsize=None)
def _run(strategy: str, nprocs: int, model: str, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--model", model, "--strategy", strategy, *extra], timeout=400)


def _assert_same_training(ours: dict, ref: dict) -> None:
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 0
    diffs = [abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"])]
    assert max(diffs) < TOL, f"per-step losses differ by up to {max(diffs):.2e}: {ours['train_loss']} vs {ref['train_loss']}"
    assert ref["train_loss"][0] != ref["train_loss"][-1], "the reference did not train"
    assert len(ours["val_loss"]) == len(ref["val_loss"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["val_loss"], ref["val_loss"])) < TOL


def test_dp2_distributed_optimizer_with_overlap_matches_ddp():
    ours = _run("megatron", 2, "gpt", *ZERO, *OVERLAP, *SMALL_BUCKETS)
    _assert_same_training(ours, _run("ddp", 2, "gpt"))


def test_dp2_overlapped_all_reduce_matches_ddp():
    ours = _run("megatron", 2, "gpt", *OVERLAP, *SMALL_BUCKETS)
    _assert_same_training(ours, _run("ddp", 2, "gpt"))


def test_dp2_distributed_optimizer_sgd_clipping_and_accumulation():
    ours = _run("megatron", 2, "gpt", *ZERO, *OVERLAP, *SMALL_BUCKETS, *SGD_CLIP)
    ref = _run("ddp", 2, "gpt", *SGD_CLIP)
    unclipped = _run("ddp", 2, "gpt", "--optimizer", "sgd", "--accumulate", "2")
    assert max(abs(a - b) for a, b in zip(ref["train_loss"], unclipped["train_loss"])) > 5e-3, "clip had no effect"
    _assert_same_training(ours, ref)


def test_tp2_dp2_distributed_optimizer_with_overlap_matches_ddp():
    ours = _run("megatron", 4, "bert", "--tp", "2", *ZERO, *OVERLAP, *SMALL_BUCKETS)
    _assert_same_training(ours, _run("ddp", 2, "bert"))


def test_tp2_dp2_distributed_optimizer_clips_by_the_whole_model_norm():
    # vocab-parallel tied embedding (sharded), replicated LayerNorms: each counted once in the norm
    ours = _run("megatron", 4, "gpt", "--tp", "2", "--user-plan", *ZERO, *SGD_CLIP)
    _assert_same_training(ours, _run("ddp", 2, "gpt", *SGD_CLIP))


def test_pp2_dp2_distributed_optimizer_with_overlap_and_a_tied_embedding():
    # the tied embedding's bucket waits for the embedding-group sum; microbatches = backward passes
    ours = _run("megatron", 4, "gpt", "--pp", "2", "--user-plan", *ZERO, *OVERLAP, "--bucket-numel", "3000")
    _assert_same_training(ours, _run("ddp", 2, "gpt"))


def _max_diff(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_distributed_optimizer_checkpoint_resumes_with_and_without_it(tmp_path):
    """ModelCheckpoint's epoch-0 checkpoint of a dp=2 distributed-optimizer run (whole, torch-format
    optimizer state in the DCP checkpoint) resumes exactly, with the distributed optimizer and
    with the plain one."""
    common = ["--user-plan", "--n-train", "32", "--no-val", "--layers", "2"]
    folder = tmp_path / "ckpts"
    straight = _run("megatron", 2, "gpt", *common, *ZERO, "--epochs", "2", "--ckpt-dir", str(folder))
    ckpt = str(folder / "epoch=0-step=4.ckpt")
    assert len(straight["train_loss"]) == 8
    for extra in (ZERO, ()):
        resumed = run_script(SCRIPT, 2, ["--model", "gpt", "--strategy", "megatron", *common, *extra, "--epochs", "2", "--resume", ckpt], timeout=400)
        assert _max_diff(resumed["train_loss"], straight["train_loss"][4:]) < 1e-5, extra
