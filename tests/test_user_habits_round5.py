"""Lightning habits, round 5, against Lightning's own DDPStrategy (per-step losses within 2e-4).

One launch per layout of tests/scripts/habits_round5.py runs every habit one after another
(tests/helpers/round5_habits.py): tp2 and pp2 against DDP on one process, dp2 against DDP on two.

* Trainer flags: ``fast_dev_run`` (True and 3), ``overfit_batches``, ``limit_train_batches=0.5``,
  ``deterministic``, ``num_sanity_val_steps=-1``, ``inference_mode=False``, ``barebones``,
  ``reload_dataloaders_every_n_epochs``, ``check_val_every_n_epoch``, ``detect_anomaly`` (and the NaN
  it names), ``profiler="simple"``/``"advanced"``: DDP's losses, logged values and hook counts (the
  step hooks run once per microbatch under pp, as the README says);
* a DataModule's three batch-transfer hooks (once per batch on every rank, a random augmentation in
  ``on_after_batch_transfer`` made one by the batch broadcast), ``self.trainer.datamodule`` in the
  step, ``setup(stage)`` per stage, its ``state_dict`` saved and given back on resume;
* a collate_fn's own batch class moved by ``transfer_batch_to_device`` and a dataclass batch (pp2:
  the class was refused with a message naming no fix; the dataclass now splits into microbatches);
* ``trainer.test(ckpt_path="best")`` after ``ModelCheckpoint(monitor=...)``, ``predict(return_predictions=False)``
  with a per-batch ``BasePredictionWriter``;
* ``Trainer(sync_batchnorm=True)``: was silently ignored; now converted over the data-parallel group,
  and refused on CPU as DDP refuses it.
"""
import tempfile
from pathlib import Path

import pytest

from tests.helpers.habit_launches import TOL, Launches, close as _close
from tests.helpers.launch import run_script_to_the_end

SCRIPT = Path(__file__).parent / "scripts" / "habits_round5.py"
pytestmark = pytest.mark.slow

FLAGS = ["fast-dev-run", "fast-dev-run-3", "overfit-batches", "limit-train-half", "deterministic", "sanity-all",
         "no-inference-mode", "barebones", "reload-loaders", "val-every-2-epochs", "detect-anomaly"]
SPLIT = FLAGS + ["profiler-simple", "profiler-advanced", "datamodule-hooks", "test-best", "predict-no-return",
                 "custom-batch", "dataclass-batch", "max-time"]
DATA = ["datamodule-hooks", "limit-train-half", "sync-batchnorm"]
LAUNCHES = {  # layout: (processes, strategy arguments, habits)
    "ddp": (1, ["--strategy", "ddp"], SPLIT + ["detect-anomaly-nan", "sync-batchnorm"]),
    "tp2": (2, ["--strategy", "megatron", "--tp", "2"], SPLIT + ["detect-anomaly-nan", "sync-batchnorm"]),
    "pp2": (2, ["--strategy", "megatron", "--pp", "2"], SPLIT),  # a NaN raised on one stage stops the launch
    "ddp2": (2, ["--strategy", "ddp", "--dp", "2"], DATA),
    "dp2": (2, ["--strategy", "megatron", "--dp", "2"], DATA),
}
REFERENCE = {"tp2": "ddp", "pp2": "ddp", "dp2": "ddp2"}


LAUNCHED = Launches(SCRIPT, LAUNCHES, REFERENCE, "habits5-")
_run, _pair = LAUNCHED.run, LAUNCHED.pair


def _same_logged(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    _close([ours[k] for k in sorted(ours)] or [0.0], [ref[k] for k in sorted(ref)] or [0.0])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("habit", FLAGS)
def test_trainer_flags(layout, habit):
    ours, ref = _pair(layout, habit)
    _close(ours["losses"], ref["losses"])
    _same_logged(ours["logged"], ref["logged"])
    assert ours["global_step"] == ref["global_step"]
    per_batch = 2 if layout == "pp2" else 1  # the step runs once per microbatch under pp (README)
    for hook, n in ref["calls"].items():
        assert ours["calls"][hook] == (n * per_batch if hook.endswith("_step") else n), (hook, ours["calls"], ref["calls"])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_profilers_wrap_the_same_hooks(layout):
    ours, ref = _pair(layout, "profiler-simple")
    _close(ours["losses"], ref["losses"])
    assert ours["actions"] == ref["actions"]
    _close(*(r["losses"] for r in _pair(layout, "profiler-advanced")))


def test_detect_anomaly_names_the_backward_that_made_nan():
    assert _run("tp2")["detect-anomaly-nan"]["raised"] == _run("ddp")["detect-anomaly-nan"]["raised"]
    assert "SqrtBackward0" in _run("ddp")["detect-anomaly-nan"]["raised"]


def test_detect_anomaly_at_pp2_stops_every_rank_naming_the_stage_that_made_nan():
    """The stage whose backward makes the NaN raises it; the watchdog stops the other stage at once."""
    ranks = run_script_to_the_end(SCRIPT, 2, ["--strategy", "megatron", "--pp", "2", "--habits", "detect-anomaly-nan",
                                              "--dir", tempfile.mkdtemp(prefix="habits5-")], timeout=120)
    assert all(code is not None for code, _, _ in ranks), "a rank hung"
    assert any("Function 'SqrtBackward0' returned nan values" in out for _, out, _ in ranks)
    assert any("because rank 1 (tp 0, pp 1, dp 0) failed" in out for _, out, _ in ranks)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_max_time_stops_every_rank_after_the_same_step(layout):
    ours, ref = _pair(layout, "max-time")
    assert ours["global_step"] == ours["max_global_step"] >= 1
    n = min(len(ours["losses"]), len(ref["losses"]))  # how many steps fit depends on the clock
    _close(ours["losses"][:n], ref["losses"][:n])


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_datamodule_hooks_state_and_stages(layout):
    ours, ref = _pair(layout, "datamodule-hooks")
    _close(ours["losses"], ref["losses"])
    assert ours["every_rank"] == [ref["hooks"]] * len(ours["every_rank"])  # each once per batch, on every rank
    assert ours["hooks"] == ref["hooks"] and ours["loaded"] == ref["loaded"] == {"epochs_seen": 1}
    assert ours["stages"] == ref["stages"] and ours["resumed_stages"] == ref["resumed_stages"]
    _same_logged(ours["logged"], ref["logged"])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("habit", ["custom-batch", "dataclass-batch"])
def test_batch_classes(layout, habit):
    _close(*(r["losses"] for r in _pair(layout, habit)))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_test_best_and_predict_without_returning(layout):
    ours, ref = _pair(layout, "test-best")
    _close(ours["losses"], ref["losses"])
    assert ours["best"] == ref["best"] and abs(ours["best_score"] - ref["best_score"]) <= TOL
    _close([ours["tested"][0]["test_loss"]], [ref["tested"][0]["test_loss"]])
    ours, ref = _pair(layout, "predict-no-return")
    assert ours["returned"] is ref["returned"] is None
    assert ours["files"] == ref["files"] and ours["batch_indices"] == ref["batch_indices"]
    _close([v for x in ours["written"] for v in x], [v for x in ref["written"] for v in x])


def test_limit_train_batches_at_dp2():
    ours, ref = _pair("dp2", "limit-train-half")
    _close(ours["losses"], ref["losses"])
    assert ours["calls"] == ref["calls"]


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_sync_batchnorm_is_applied_not_ignored(layout):
    """On CPU torch's SyncBatchNorm cannot run, and DDP refuses it; ours refused too (it ran silently)."""
    ours, ref = _pair(layout, "sync-batchnorm")
    assert ref["raised"] and "GPU" in ref["raised"]
    assert "sync_batchnorm=True" in ours["raised"] and "sync_batchnorm=False" in ours["raised"]
    assert ours["losses"] == ref["losses"] == []
