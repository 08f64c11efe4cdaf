"""Ordinary Lightning habits give what Lightning's own DDPStrategy gives.

One launch per set of habits and layout of ``tests/scripts/user_habits.py`` (a Hugging Face BERT
classifier fine-tuned as users write it, see tests/helpers/habit_model.py) against DDPStrategy on one
process (two for the distributed optimizer at dp2): per-step losses, every row of ``CSVLogger``'s
metrics.csv (losses, per-loader validation losses, ``LearningRateMonitor``'s learning rates: the
plateau halving, one-cycle, linear warm-up), the checkpoint ``ModelCheckpoint(monitor="val_loss")``
keeps, ``trainer.validate`` before ``fit``, a second ``fit`` on the same Trainer, and embeddings
unfrozen at an epoch's start (the gradient buffer follows ``requires_grad``), and a pp2 stage holding
nothing trainable under an optimizer over the trainable parameters (its optimizer starts with one
empty group). Loading the best checkpoint with ``load_from_checkpoint`` is in
tests/test_load_from_checkpoint.py.
"""
import pytest

from tests.helpers.habit_runs import FROZEN_EMBEDDINGS, FROZEN_FIRST_STAGE, FROZEN_LAYERS, REFIT, UNFREEZE, habit_run

TOL = 2e-4
pytestmark = pytest.mark.slow

CASES = {"frozen-embeddings-tp2": ("tp2", "ddp", FROZEN_EMBEDDINGS), "frozen-layers-pp2": ("pp2", "ddp", FROZEN_LAYERS),
         "refit-pp2": ("pp2", "ddp", REFIT), "frozen-embeddings-dp2-zero": ("dp2-zero", "ddp2", FROZEN_EMBEDDINGS),
         "unfreeze-tp2": ("tp2", "ddp", UNFREEZE), "unfreeze-pp2": ("pp2", "ddp", UNFREEZE),
         "frozen-first-stage-pp2": ("pp2", "ddp", FROZEN_FIRST_STAGE)}


def _same_csv(ours: list[dict], ref: list[dict]) -> None:
    """metrics.csv row by row: the same columns, the same cells filled, numbers within TOL."""
    assert len(ours) == len(ref) and ours[0].keys() == ref[0].keys(), (len(ours), len(ref), ours[0].keys())
    for row, (mine, theirs) in enumerate(zip(ours, ref)):
        for key, value in theirs.items():
            assert (mine[key] == "") == (value == ""), (row, key, mine[key], value)
            if value:
                assert abs(float(mine[key]) - float(value)) <= TOL, (row, key, mine[key], value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_habits_give_ddps_losses_logs_and_best_checkpoint(case):
    layout, reference, habits = CASES[case]
    (ours, _), (ref, _) = habit_run(layout, habits), habit_run(reference, habits)
    assert ours["global_step"] == ref["global_step"] and len(ours["losses"]) == len(ref["losses"])
    assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) <= TOL
    _same_csv(ours["csv"], ref["csv"])
    assert ours["best"].rsplit("/", 1)[-1] == ref["best"].rsplit("/", 1)[-1]
    assert abs(ours["best_score"] - ref["best_score"]) <= TOL
    assert abs(ours["best_weights_l1"] / ref["best_weights_l1"] - 1) <= TOL  # reloaded by rank 0 alone, in the job
    assert ours["final"].keys() == ref["final"].keys()
    assert all(abs(ours["final"][k] - v) <= TOL for k, v in ref["final"].items())
    frozen = "--freeze-embeddings" in habits or "--freeze-layers" in habits
    assert bool(ours["frozen_drift"]) == frozen  # rank 0's frozen parameters, shards too: still, unless unfrozen
    assert any(ours["frozen_drift"].values()) == ("--unfreeze-epoch" in habits)


def test_unfrozen_parameters_are_averaged_over_data_parallel_replicas():
    """At dp2 the parameters unfrozen mid-run are reduced with the rest: validation equals one process
    with the same global batch. (Lightning's DDPStrategy on 2 processes does not: torch DDP's reducer
    keeps the parameters that required grad when it wrapped the model, so those drift apart.)"""
    ours, one = habit_run("dp2", UNFREEZE)[0], habit_run("ddp-batch8", UNFREEZE)[0]
    mine, truth = ([(r["step"], float(r["val_loss"])) for r in run["csv"] if r["val_loss"]] for run in (ours, one))
    assert len(mine) == len(truth) > 4 and [s for s, _ in mine] == [s for s, _ in truth]
    assert max(abs(a - b) for (_, a), (_, b) in zip(mine, truth)) <= TOL


def test_the_habits_did_what_they_say():
    """The reference runs exercise what the names promise (else a match would prove little)."""
    plateau = [float(r["lr-AdamW"]) for r in habit_run("ddp", FROZEN_EMBEDDINGS)[0]["csv"] if r["lr-AdamW"]]
    assert plateau[0] == 1e-3 and plateau[-1] == 5e-4  # halved after the epoch-1 validation
    refit, _ = habit_run("ddp", REFIT)
    assert refit["global_step"] == 17 and len(refit["validate_first"]) == 2  # 13 + 4 steps; both loaders
    assert {"lr-AdamW/pg1", "lr-AdamW/pg2"} <= refit["final"].keys()
