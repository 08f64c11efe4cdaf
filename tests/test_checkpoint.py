"""Sharded checkpoints under the strategy: save, resume exactly, and the other trainer entry points."""
from pathlib import Path

import pytest

from tests.helpers import checkpoint_runs as runs
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
pytestmark = pytest.mark.slow


def _max_diff(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_save_after_fit_then_resume_continues_exactly(tmp_path):
    """trainer.save_checkpoint after a 1-epoch fit on tp=2, resumed on tp=2."""
    straight, _ = runs.gpt_tp2_pp2()  # the same model and data: the uninterrupted reference
    common = runs.GPT + ["--tp", "2"]
    ckpt = tmp_path / "step4.ckpt"
    first = run_script(SCRIPT, 2, common + ["--epochs", "1", "--save", str(ckpt)])
    assert (ckpt / ".metadata").is_file() and not (tmp_path / "step4.ckpt.tmp").exists()
    resumed = run_script(SCRIPT, 2, common + ["--epochs", "2", "--resume", str(ckpt)])
    assert _max_diff(first["train_loss"], straight["train_loss"][:4]) < 1e-5
    assert _max_diff(resumed["train_loss"], straight["train_loss"][4:]) < 1e-5


# (layout, processes): the checkpoint was written with tp=2, pp=2 on 4 processes
RESHARD = {
    "tp2-pp2": (["--tp", "2", "--pp", "2"], 4),
    "tp1-pp2": (["--tp", "1", "--pp", "2"], 2),
    "tp2-pp1": (["--tp", "2", "--pp", "1"], 2),
    "tp1-pp1": (["--tp", "1", "--pp", "1"], 1),
}


@pytest.mark.parametrize("layout", list(RESHARD))
def test_resume_a_tp2_pp2_checkpoint_on_any_layout(layout):
    """ModelCheckpoint's epoch-end checkpoint of a tp=2, pp=2 run resumes on another layout and the
    next losses are the uninterrupted run's: model AND Adam state (moments, step) were restored."""
    straight, folder = runs.gpt_tp2_pp2()
    ckpt = folder / runs.EPOCH0
    assert (ckpt / ".metadata").is_file(), sorted(p.name for p in folder.iterdir())
    args, nprocs = RESHARD[layout]
    args += ["--epochs", "2", "--resume", str(ckpt), "--test-ckpt", str(ckpt)]
    resumed = run_script(SCRIPT, nprocs, runs.GPT + args, timeout=400)
    assert len(straight["train_loss"]) == 8 and len(resumed["train_loss"]) == 4
    assert _max_diff(resumed["train_loss"], straight["train_loss"][4:]) < (1e-6 if layout == "tp2-pp2" else 1e-5)
    # trainer.test(ckpt_path=...) after fit loads into the already sharded module, in place
    assert abs(resumed["test_ckpt"] - straight["test_ckpt"]) < 1e-5


def test_hf_bert_with_padded_vocab_resumes_from_tp2_on_tp1():
    straight, folder = runs.bert_tp2()
    resumed = run_script(SCRIPT, 1, runs.BERT + ["--tp", "1", "--epochs", "2", "--resume", str(folder / runs.EPOCH0)])
    assert _max_diff(resumed["train_loss"], straight["train_loss"][4:]) < 1e-5


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_validate_test_predict_match_ddp(layout):
    args = ["--model", "bert", "--layers", "2", "--steps", "2", "--eval"]
    ours = run_script(SCRIPT, 2, args + ["--strategy", "megatron", *layout])
    ref = run_script(SCRIPT, 1, args + ["--strategy", "ddp"])
    assert abs(ours["validate"] - ref["validate"]) < 2e-4
    assert abs(ours["test"] - ref["test"]) < 2e-4
    assert len(ours["predict"]) == len(ref["predict"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["predict"], ref["predict"])) < 2e-4
