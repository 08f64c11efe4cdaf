"""Sharded checkpoints under the strategy: save, resume exactly, and the other trainer entry points."""
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--tp", "2", "--pp", "2")], ids=["tp2", "tp2-pp2"])
def test_resume_from_a_sharded_checkpoint_continues_exactly(tmp_path, layout):
    nprocs = 2 if len(layout) == 2 else 4
    common = ["--model", "gpt", "--strategy", "megatron", "--user-plan", "--layers", "2", "--n-train", "16", *layout]
    straight = run_script(SCRIPT, nprocs, common + ["--steps", "8"])
    ckpt = tmp_path / "step4.ckpt"
    first = run_script(SCRIPT, nprocs, common + ["--steps", "4", "--save", str(ckpt)])
    assert (ckpt / "megastrategy_meta.json").is_file() and len(list(ckpt.glob("rank_*.pt"))) == nprocs
    resumed = run_script(SCRIPT, nprocs, common + ["--steps", "8", "--resume", str(ckpt)])
    assert first["train_loss"] == straight["train_loss"][:4]
    assert len(resumed["train_loss"]) == 4
    assert max(abs(a - b) for a, b in zip(resumed["train_loss"], straight["train_loss"][4:])) < 1e-6


def test_resume_on_another_layout_is_refused_with_a_clear_message(tmp_path):
    ckpt = tmp_path / "c.ckpt"
    common = ["--model", "gpt", "--strategy", "megatron", "--user-plan", "--n-train", "16", "--steps", "2"]
    run_script(SCRIPT, 2, common + ["--tp", "2", "--save", str(ckpt)])
    with pytest.raises(AssertionError, match="was written with layout"):
        run_script(SCRIPT, 1, common + ["--resume", str(ckpt)])


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_validate_test_predict_match_ddp(layout):
    args = ["--model", "bert", "--layers", "2", "--steps", "2", "--eval"]
    ours = run_script(SCRIPT, 2, args + ["--strategy", "megatron", *layout])
    ref = run_script(SCRIPT, 1, args + ["--strategy", "ddp"])
    assert abs(ours["validate"] - ref["validate"]) < 2e-4
    assert abs(ours["test"] - ref["test"]) < 2e-4
    assert len(ours["predict"]) == len(ref["predict"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["predict"], ref["predict"])) < 2e-4
