"""Training equivalence: MegatronStrategy(tp=...) vs Lightning's own DDPStrategy, real processes.

Each run trains the same unchanged LightningModule from the same seed with dropout off in fp32;
rank 0's per-step train_loss and the validation loss must agree within 2e-4.
"""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
TOL = 2e-4
pytestmark = pytest.mark.slow


@lru_cache(maxsize=None)
def _run(strategy: str, nprocs: int, model: str, *extra: str) -> dict:
    return run_script(SCRIPT, nprocs, ["--model", model, "--strategy", strategy, *extra], timeout=300)


def _assert_same_training(ours: dict, ref: dict) -> None:
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 0
    diffs = [abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"])]
    assert max(diffs) < TOL, f"per-step losses differ by up to {max(diffs):.2e}: {ours['train_loss']} vs {ref['train_loss']}"
    assert ref["train_loss"][0] != ref["train_loss"][-1], "the reference did not train"
    assert len(ours["val_loss"]) == len(ref["val_loss"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["val_loss"], ref["val_loss"])) < TOL


@pytest.mark.parametrize(
    "model, extra",
    [("bert", ()), ("gpt", ("--user-plan",)), ("encoder", ())],
    ids=["hf-bert", "gpt-user-plan-tied", "torch-transformer-encoder"],
)
def test_tp2_on_2_processes_matches_single_process_ddp(model, extra):
    _assert_same_training(_run("megatron", 2, model, "--tp", "2", *extra), _run("ddp", 1, model))


def test_bert_tp2_dp2_on_4_processes_matches_ddp_on_2():
    _assert_same_training(_run("megatron", 4, "bert", "--tp", "2"), _run("ddp", 2, "bert"))


def test_gradient_clipping_and_accumulation_use_the_whole_model():
    extra = ("--clip", "0.05", "--accumulate", "2", "--optimizer", "sgd")
    ours = _run("megatron", 2, "gpt", "--tp", "2", "--user-plan", *extra)
    ref = _run("ddp", 1, "gpt", *extra)
    unclipped = _run("ddp", 1, "gpt", "--accumulate", "2", "--optimizer", "sgd")
    assert max(abs(a - b) for a, b in zip(ref["train_loss"], unclipped["train_loss"])) > 5e-3, "clip had no effect"
    _assert_same_training(ours, ref)
