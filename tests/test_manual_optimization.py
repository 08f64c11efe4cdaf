"""Manual optimization (``automatic_optimization=False``: ``manual_backward``, ``clip_gradients``,
``opt.step()``, ``opt.zero_grad()``) under tensor and data parallelism trains as under DDPStrategy.

SGD (sensitive to the gradient's scale, unlike Adam) and clipping at 0.5: a gradient that was not
reduced over tp or dp, or clipped by a partial norm, changes the losses.
"""
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
pytestmark = pytest.mark.slow


@lru_cache(maxsize=None)
def _run(strategy: str, nprocs: int, *extra: str) -> dict:
    args = ["--model", "bert-manual", "--strategy", strategy, "--optimizer", "sgd", *extra]
    return run_script(SCRIPT, nprocs, args, timeout=300)


@pytest.mark.parametrize("nprocs, dp, extra", [(2, 1, ("--tp", "2")), (4, 2, ("--tp", "2"))], ids=["tp2", "tp2-dp2"])
def test_manual_optimization_matches_ddp(nprocs, dp, extra):
    ours, ref = _run("megatron", nprocs, *extra), _run("ddp", dp)
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 1
    assert ref["train_loss"][0] != ref["train_loss"][-1], "the reference did not train"
    diff = max(abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"]))
    assert diff < 2e-4, f"losses differ by {diff:.2e}: {ours['train_loss']} vs {ref['train_loss']}"
