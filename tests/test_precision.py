"""Mixed precision with the strategy, against Lightning's own DDP at the same precision."""
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
pytestmark = pytest.mark.slow
BF16_TOL = 3e-2  # bf16 keeps 8 bits of mantissa; TP changes the order of partial sums


@pytest.mark.parametrize("precision, tol", [("bf16-mixed", BF16_TOL), ("16-mixed", 5e-3)])
def test_mixed_precision_tp2_pp2_matches_ddp(precision, tol):
    args = ["--model", "gpt", "--user-plan", "--layers", "4", "--steps", "6", "--precision", precision]
    ours = run_script(SCRIPT, 4, args + ["--strategy", "megatron", "--tp", "2", "--pp", "2"], timeout=400)
    ref = run_script(SCRIPT, 1, args + ["--strategy", "ddp"], timeout=400)
    diffs = [abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"])]
    assert len(diffs) == 6 and max(diffs) < tol, (ours["train_loss"], ref["train_loss"])
    assert ref["train_loss"][-1] < ref["train_loss"][0]
