"""Fault injection: a failing or killed rank stops the whole job within seconds, every process
exits, and the survivors' output names the failing rank and what it was doing."""
import json
from pathlib import Path

import pytest

from tests.helpers.launch import run_script_to_the_end

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
pytestmark = pytest.mark.slow
BOUND_S = 90  # generous: process start-up on 2 loaded cores is most of it


def _job(fail_rank, how, layout=("--pp", "4"), nprocs=4, extra=()):
    args = ["--model", "gpt", "--strategy", "megatron", "--user-plan", "--layers", "4", "--steps", "6",
            "--fail-rank", str(fail_rank), "--fail-step", "2", "--fail-how", how, "--heartbeat-timeout", "5",
            *layout, *extra]
    return run_script_to_the_end(SCRIPT, nprocs, args, timeout=240)


@pytest.mark.parametrize("fail_rank", [0, 1, 3], ids=["first-stage", "middle-stage", "last-stage"])
def test_a_rank_that_raises_stops_every_rank_with_its_name(fail_rank):
    results = _job(fail_rank, "raise")
    assert all(code is not None for code, _, _ in results), "a rank hung"
    assert all(code != 0 for code, _, _ in results), [c for c, _, _ in results]
    assert max(t for _, _, t in results) - min(t for _, _, t in results) < BOUND_S
    for rank, (code, out, _) in enumerate(results):
        if rank != fail_rank:
            assert f"rank {fail_rank} (tp 0, pp {fail_rank}, dp 0) failed while training step 2: RuntimeError: injected failure" in out, out[-2000:]
    assert "injected failure" in results[fail_rank][1]


def test_a_rank_killed_by_sigkill_is_named_by_the_survivors():
    results = _job(2, "kill")
    assert all(code is not None for code, _, _ in results), "a rank hung"
    assert results[2][0] == -9
    survivors = [out for rank, (_, out, _) in enumerate(results) if rank != 2]
    assert all(code != 0 for rank, (code, _, _) in enumerate(results)), [c for c, _, _ in results]
    assert any("rank 2 (tp 0, pp 2, dp 0) stopped responding" in out for out in survivors), survivors[0][-2000:]


def test_nan_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    results = _job(1, "nan", layout=("--tp", "2"), nprocs=2, extra=("--on-nonfinite", "skip"))
    assert [code for code, _, _ in results] == [0, 0], results[0][1][-3000:]
    assert "non-finite gradients on rank(s) [1] at step 2" in results[0][1]


def test_nan_gradient_with_raise_stops_every_rank_consistently():
    results = _job(1, "nan", layout=("--tp", "2"), nprocs=2, extra=("--on-nonfinite", "raise"))
    assert all(code not in (None, 0) for code, _, _ in results)
    assert all("non-finite gradients on rank(s) [1] at step 2" in out for _, out, _ in results)


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    from megastrategy.checkpoint import consolidate
    from tests.helpers.launch import run_script

    ckpts = tmp_path / "ckpts"
    common = ["--model", "gpt", "--strategy", "megatron", "--user-plan", "--tp", "2", "--n-train", "16", "--steps", "4",
              "--ckpt-dir", str(ckpts), "--heartbeat-timeout", "5"]
    results = run_script_to_the_end(SCRIPT, 2, common + ["--epochs", "3", "--fail-rank", "1", "--fail-step", "1",
                                                         "--fail-how", "kill-in-save"], timeout=240)
    assert all(code is not None for code, _, _ in results), "a rank hung"
    assert results[1][0] == -9 and results[0][0] != 0
    first = ckpts / "epoch=0-step=4.ckpt"
    assert (first / ".metadata").is_file(), sorted(p.name for p in ckpts.iterdir())
    for p in ckpts.iterdir():  # nothing half-written is visible under a final name
        assert p.name.endswith(".tmp") or (p / ".metadata").is_file(), p
    assert "wte.weight" in consolidate(first)
    resumed = run_script(SCRIPT, 2, common + ["--epochs", "2", "--resume", str(first)])
    assert len(resumed["train_loss"]) == 4  # the second epoch ran from the surviving checkpoint
