"""``async_checkpoint=True``: the same checkpoints, written in the background, as crash-safe as
synchronous ones."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megastrategy.checkpoint import consolidate
from tests.helpers import checkpoint_runs as runs
from tests.helpers.launch import run_script, run_script_to_the_end

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
pytestmark = pytest.mark.slow


def test_async_checkpoints_hold_what_synchronous_ones_hold_and_resume_the_same(tmp_path):
    straight, sync_folder = runs.bert_tp2()
    args = runs.BERT + ["--tp", "2", "--async-checkpoint"]
    written = run_script(SCRIPT, 2, args + ["--epochs", "2", "--ckpt-dir", str(tmp_path)], timeout=400)
    assert written["train_loss"] == straight["train_loss"]  # saving in the background changes no step
    assert sorted(p.name for p in tmp_path.iterdir()) == [runs.EPOCH0, "epoch=1-step=8.ckpt"]  # no .tmp left
    ours, theirs = consolidate(tmp_path / runs.EPOCH0), consolidate(sync_folder / runs.EPOCH0)
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    resumed = run_script(SCRIPT, 2, args + ["--epochs", "2", "--resume", str(tmp_path / runs.EPOCH0)], timeout=400)
    assert resumed["train_loss"] == straight["train_loss"][4:]


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    common = ["--model", "gpt", "--strategy", "megatron", "--user-plan", "--tp", "2", "--n-train", "16", "--steps", "4",
              "--ckpt-dir", str(tmp_path), "--heartbeat-timeout", "5", "--async-checkpoint"]
    results = run_script_to_the_end(SCRIPT, 2, common + ["--epochs", "3", "--fail-rank", "1", "--fail-step", "1",
                                                         "--fail-how", "kill-in-save"], timeout=240)
    assert all(code is not None for code, _, _ in results), "a rank hung"
    assert results[1][0] == -9 and results[0][0] != 0
    first = tmp_path / runs.EPOCH0
    assert (first / ".metadata").is_file(), sorted(p.name for p in tmp_path.iterdir())
    for p in tmp_path.iterdir():  # nothing half-written is visible under a final name
        assert p.name.endswith(".tmp") or (p / ".metadata").is_file(), p
    assert "wte.weight" in consolidate(first)
    # and training resumes from it: the two epochs after epoch 0, 4 steps each, on the same layout
    resumed = run_script(SCRIPT, 2, common + ["--epochs", "3", "--resume", str(first)], timeout=240)
    assert len(resumed["train_loss"]) == 8 and all(math.isfinite(x) for x in resumed["train_loss"])
