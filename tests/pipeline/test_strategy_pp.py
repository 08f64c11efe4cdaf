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


def test_clip_and_accumulation_under_tp_pp_use_the_global_norm():
    extra = ("--clip", "0.05", "--accumulate", "2", "--optimizer", "sgd")
    _assert_same(_run("megatron", 4, "gpt", "--tp", "2", "--pp", "2", "--user-plan", *extra), _run("ddp", 1, "gpt", *extra))
