"""Mid-epoch resume on another layout continues with the next unseen sample (issue #15).

One reference run per saved layout writes a checkpoint after 3 of its 6 steps (16 batches per
epoch, so mid-epoch) and keeps running: its last three steps are what every resume must repeat.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.checkpoint_runs import MID_EPOCH_BERT, mid_epoch_bert_run
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
pytestmark = pytest.mark.slow

# tp=2, pp=2 (dp=1) resumed with dp=1 on other tensor/pipeline layouts: (args, processes)
SAME_DP = {
    "tp1-pp2": (["--tp", "1", "--pp", "2"], 2),
    "tp2-pp1": (["--tp", "2", "--pp", "1"], 2),
    "tp1-pp1": (["--tp", "1", "--pp", "1"], 1),
}


@pytest.mark.parametrize("layout", list(SAME_DP))
def test_a_tp2_pp2_checkpoint_taken_mid_epoch_continues_with_the_next_batch_on(layout):
    straight, ckpt = mid_epoch_bert_run(("--tp", "2", "--pp", "2"), 4)
    args, nprocs = SAME_DP[layout]
    resumed = run_script(SCRIPT, nprocs, [*MID_EPOCH_BERT, *args, "--resume", str(ckpt)], timeout=400)
    assert resumed["example_ids"] == straight["example_ids"][3:]
    losses, expected = resumed["train_loss"], straight["train_loss"][3:]
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, expected)) < 2e-4, (losses, expected)


def test_a_checkpoint_of_unequal_stages_resumes_on_another_split():
    """3 layers saved as stages of 2 + 1 (automatic) and resumed as 1 + 2 (named): names are global."""
    straight, ckpt = mid_epoch_bert_run(("--pp", "2", "--layers", "3"), 2)
    resumed = run_script(SCRIPT, 2, [*MID_EPOCH_BERT, "--pp", "2", "--layers", "3", "--stage-layers", "1,2",
                                     "--resume", str(ckpt)], timeout=400)
    losses, expected = resumed["train_loss"], straight["train_loss"][3:]
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, expected)) < 2e-4, (losses, expected)


# tp=2, dp=2 with 4 samples per device (global batch 8) resumed with the same global batch
OTHER_DP = {
    "tp2-dp1": (["--tp", "2", "--batch-size", "8"], 2),
    "tp1-dp4": (["--tp", "1", "--batch-size", "2"], 4),
}


@pytest.mark.parametrize("layout", list(OTHER_DP))
def test_a_dp2_checkpoint_resumed_on_another_dp_sees_every_example_of_the_epoch_once(layout):
    straight, ckpt = mid_epoch_bert_run(("--tp", "2"), 4)
    args, nprocs = OTHER_DP[layout]
    resumed = run_script(SCRIPT, nprocs, [*MID_EPOCH_BERT, *args, "--resume", str(ckpt)],
                         timeout=400)
    before, after = straight["example_ids"][:3], resumed["example_ids"]
    assert [len(ids) for ids in before + after] == [8] * 6  # global batches of 8 examples
    seen = Counter(i for ids in before + after for i in ids)
    assert max(seen.values()) == 1, sorted(i for i, n in seen.items() if n > 1)  # none seen twice...
    assert after == straight["example_ids"][3:]  # ...and none skipped: the same global stream


def test_another_global_batch_mid_epoch_is_refused_before_training():
    _, ckpt = mid_epoch_bert_run(("--tp", "2"), 4)
    with pytest.raises(AssertionError) as err:
        run_script(SCRIPT, 2, [*MID_EPOCH_BERT, "--tp", "2", "--resume", str(ckpt)], timeout=300)
    message = str(err.value)
    assert "global batch of 8 samples, but this run's global batch is 4 (batch_size 4 x dp 1)" in message, message
    assert "Use batch_size=8 per device (dp=1)" in message
    assert "train_loss" not in message



def test_a_zb_v_checkpoint_resumes_under_1f1b():
    """ZB-V holds stages 0 and 3 on rank 0 (the V): its checkpoint, keyed by layer, resumes on the ring."""
    zb_v = ("--layers", "4", "--pp", "2", "--pipeline-schedule", "zb_v", "--num-microbatches", "4")
    straight, ckpt = mid_epoch_bert_run(zb_v, 2)
    resumed = run_script(SCRIPT, 2, [*MID_EPOCH_BERT, "--layers", "4", "--pp", "2", "--resume", str(ckpt)], timeout=400)
    assert resumed["example_ids"] == straight["example_ids"][3:]
    losses, expected = resumed["train_loss"], straight["train_loss"][3:]
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, expected)) < 2e-4, (losses, expected)
