"""Issue #16: the overlapped reduction is the default, and ZeRO-1's gather can overlap the forward.

Real processes train the unchanged test modules; rank 0's per-step losses must equal Lightning's
DDPStrategy within 2e-4 (the DDP references are shared with test_strategy_distributed_optimizer).
``early_bucket_starts`` counts buckets whose reduction a backward hook started (0: nothing
overlapped); ``gathers_waited_in_forward`` counts buckets a forward pre-hook finished gathering.
"""
import pytest

from tests.ddp.test_strategy_distributed_optimizer import SMALL_BUCKETS, ZERO, _assert_same_training, _run

GATHER = (*ZERO, "--overlap-param-gather")
pytestmark = pytest.mark.slow


def test_dp2_overlaps_by_default_bit_identical_to_overlap_off():
    default = _run("megatron", 2, "gpt", *SMALL_BUCKETS)
    off = _run("megatron", 2, "gpt", *SMALL_BUCKETS, "--overlap-grad-reduce", "off")
    assert default["early_bucket_starts"] > 1 and off["early_bucket_starts"] == 0
    assert default["train_loss"] == off["train_loss"], "overlap changed the arithmetic"
    _assert_same_training(default, _run("ddp", 2, "gpt"))


def test_dp2_zero1_gather_overlap_with_accumulation():
    ours = _run("megatron", 2, "gpt", *GATHER, *SMALL_BUCKETS, "--accumulate", "2")
    assert ours["early_bucket_starts"] > 1 and ours["gathers_waited_in_forward"] > 1
    _assert_same_training(ours, _run("ddp", 2, "gpt", "--accumulate", "2"))


def test_tp2_dp2_zero1_gather_overlap():
    ours = _run("megatron", 4, "bert", "--tp", "2", *GATHER, *SMALL_BUCKETS)
    assert ours["early_bucket_starts"] > 1 and ours["gathers_waited_in_forward"] > 1
    _assert_same_training(ours, _run("ddp", 2, "bert"))


def test_pp2_dp2_default_overlap_and_zero1_gather_with_a_tied_embedding():
    # every microbatch's backward is in the last-backward region; the tied embedding's bucket
    # waits for the embedding-group sum; the gathered stage parameters wait in the next forward
    ours = _run("megatron", 4, "gpt", "--pp", "2", "--user-plan", *GATHER, "--bucket-numel", "3000")
    assert ours["early_bucket_starts"] > 0 and ours["gathers_waited_in_forward"] > 0
    _assert_same_training(ours, _run("ddp", 2, "gpt"))


def test_tp2_dp2_sequence_parallel_default_overlap():
    # the sequence-parallel norms' gradients are summed over TP after backward: their buckets
    # are registered as changed-after-backward and never start early; the others do
    ours = _run("megatron", 4, "bert", "--tp", "2", "--sequence-parallel", *SMALL_BUCKETS)
    assert ours["early_bucket_starts"] > 0
    _assert_same_training(ours, _run("ddp", 2, "bert"))


def test_zero1_gather_overlap_checkpoint_mid_training_resumes_exactly(tmp_path):
    # ModelCheckpoint saves at on_train_batch_end, while the step's gathers are still pending:
    # the save must wait for them, so the resumed run continues the uninterrupted one
    common = ["--user-plan", "--n-train", "32", "--no-val", "--layers", "2", *GATHER, "--epochs", "2"]
    folder = tmp_path / "ckpts"
    straight = _run("megatron", 2, "gpt", *common, "--ckpt-dir", str(folder), "--ckpt-every", "3")
    resumed = _run("megatron", 2, "gpt", *common, "--resume", str(folder / "epoch=0-step=3.ckpt"))
    assert len(straight["train_loss"]) == 8
    assert max(abs(a - b) for a, b in zip(resumed["train_loss"], straight["train_loss"][3:])) < 1e-5
