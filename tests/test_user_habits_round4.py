"""Lightning habits, round 4, against Lightning's own DDPStrategy (per-step losses within 2e-4).

One launch per layout of tests/scripts/habits_round4.py runs every habit one after another
(tests/helpers/round4_habits.py): tp2 and pp2 against DDP on one process, dp2 against DDP on two.

* Lightning's ``BoringModel`` and the README's ``LitAutoEncoder`` (``nn.Sequential`` MLPs, a
  DataModule with ``prepare_data``/``setup(stage)``): refused by name at tp2 without a plan and at
  pp2 (no layer stack); at tp2 with a plan the user writes, and at dp2, DDP's losses;
* ``ModelSummary``: the whole model's counts on rank 0 (it printed a tp2 rank's half), also with an
  ``example_input_array`` (a pp2 stage ran it alone and failed);
* ``BasePredictionWriter`` (``write_on_epoch_end``, ``batch_indices``), ``predict(return_predictions=True)``
  of a dict per batch, and a ``loss.reshape(1)`` per batch (pp2 returned one per microbatch);
* the user's ``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` in ``on_before_optimizer_step``
  or between ``manual_backward`` and ``opt.step()``: DDP's norm and losses (a tp/pp rank's local norm was smaller);
* weight-decay groups built by name, ``LearningRateMonitor(log_momentum=True, log_weight_decay=True)``'s rows,
  ``strategy.reduce``, ``estimated_stepping_batches``, ``self.all_gather`` logged at epoch end;
* ``ThroughputMonitor``: the global rates count data-parallel replicas (tp2 logged twice its samples
  per second as ``samples_per_sec``); ``Tuner.scale_batch_size`` refused as under DDP;
* ``ModelPruning`` refused at tp2 and pp2 (it ranks a shard's or a stage's weights), DDP's losses at dp2;
  ``OnExceptionCheckpoint`` saves and resumes at tp2 and dp2, refused at pp2 (the save would hang).
"""
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "habits_round4.py"
TOL = 2e-4
pytestmark = pytest.mark.slow

SPLIT = ["summary", "predict-writer", "predict-structure", "manual-clip", "no-decay", "module-misc", "pruning",
         "on-exception-checkpoint", "lr-monitor-momentum", "throughput", "batch-size-finder",
         "summary-example-input", "summary-rich"]
DATA = ["boring", "autoencoder", "summary", "predict-writer", "manual-clip", "pruning", "on-exception-checkpoint", "throughput"]
#: at tp2·pp2 (4 processes), the habits whose numbers a split of both kinds could get wrong
TP_PP = ["summary", "predict-writer", "manual-clip", "no-decay", "module-misc", "throughput"]
LAUNCHES = {  # layout: (processes, strategy arguments, habits)
    "ddp": (1, ["--strategy", "ddp"], SPLIT + ["autoencoder", "manual-clip-manual-optimization"]),
    "tp2": (2, ["--strategy", "megatron", "--tp", "2"],
            SPLIT + ["boring", "autoencoder", "autoencoder-plan", "manual-clip-manual-optimization"]),
    "pp2": (2, ["--strategy", "megatron", "--pp", "2"], SPLIT + ["boring"]),
    "tp2pp2": (4, ["--strategy", "megatron", "--tp", "2", "--pp", "2"], TP_PP),
    "ddp2": (2, ["--strategy", "ddp", "--dp", "2"], DATA),
    "dp2": (2, ["--strategy", "megatron", "--dp", "2"], DATA),
}
REFERENCE = {"tp2": "ddp", "pp2": "ddp", "tp2pp2": "ddp", "dp2": "ddp2"}


@lru_cache(maxsize=None)
def _run(layout: str) -> dict:
    nprocs, args, habits = LAUNCHES[layout]
    workdir = tempfile.mkdtemp(prefix="habits4-")
    return run_script(SCRIPT, nprocs, [*args, "--habits", ",".join(habits), "--dir", workdir], timeout=300)


def _pair(layout: str, habit: str, reference_habit: str = None) -> tuple:
    ours = _run(layout)[habit]
    assert "error" not in ours, ours.get("trace")
    return ours, _run(REFERENCE[layout])[reference_habit or habit]


def _close(ours: list, ref: list, tol: float = TOL) -> None:
    assert len(ours) == len(ref) > 1, (ours, ref)
    diff = max(abs(a - b) for a, b in zip(ours, ref))
    assert diff <= tol, f"differ by {diff:.2e}: {ours} vs {ref}"


def test_lightning_demo_modules_without_a_layer_stack():
    for habit in ("boring", "autoencoder"):
        assert "tp=2 with tp_plan=None" in _run("tp2")[habit]["error"] and "Pass tp_plan" in _run("tp2")[habit]["error"]
    assert "no nn.ModuleList of identical blocks" in _run("pp2")["boring"]["error"]
    ours, ref = _pair("tp2", "autoencoder-plan", "autoencoder")
    _close(ours["losses"], ref["losses"])
    assert abs(ours["val_loss"] - ref["val_loss"]) <= TOL and ours["stages"] == ref["stages"] == ["fit"]
    for habit in ("boring", "autoencoder"):
        _close(*(r["losses"] for r in _pair("dp2", habit)))


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_model_summary_counts_the_whole_model(layout):
    ours, ref = _pair(layout, "summary")
    assert ours["counts"] == ref["counts"] and ref["counts"]["total"] > 20000
    if layout != "dp2":  # with example_input_array: the sizes run at tp2; a pp2 stage cannot run it alone ("?")
        for habit in ("summary-example-input", "summary-rich"):
            ours, ref = _pair(layout, habit)
            assert ours["counts"] == ref["counts"]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_prediction_writer_and_returned_predictions(layout):
    ours, ref = _pair(layout, "predict-writer")
    assert ours["batch_indices"] == ref["batch_indices"]
    for key in ("returned", "written"):
        assert [len(x) for x in ours[key]] == [len(x) for x in ref[key]]  # one loss per batch, as one device
        _close([v for x in ours[key] for v in x], [v for x in ref[key] for v in x])
    if layout != "dp2":
        ours, ref = _pair(layout, "predict-structure")
        assert ours["types"] == ref["types"] and ours["keys"] == ref["keys"] and ours["pred"] == ref["pred"]
        _close(ours["loss"], ref["loss"])


@pytest.mark.parametrize("layout,habit", [("tp2", "manual-clip"), ("pp2", "manual-clip"), ("dp2", "manual-clip"),
                                          ("tp2", "manual-clip-manual-optimization")])
def test_the_users_own_clip_grad_norm_clips_by_one_devices_norm(layout, habit):
    ours, ref = _pair(layout, habit)
    _close(ours["losses"], ref["losses"])
    _close(ours["norms"], ref["norms"], tol=1e-4)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_module_habits(layout):
    ours, ref = _pair(layout, "no-decay")
    _close(ours["losses"], ref["losses"])
    ours, ref = _pair(layout, "module-misc")
    _close(ours["losses"], ref["losses"])
    assert ours["estimated_stepping_batches"] == ref["estimated_stepping_batches"]
    assert ours["gathered_shape"] == ref["gathered_shape"] and ours["logged"]["gathered_mean"] == ref["logged"]["gathered_mean"]
    assert ours["param_count"] < ref["param_count"]  # self.parameters(): this rank's shards or stage (README)
    if layout == "tp2":
        _close(ours["reduced"], ref["reduced"])
    else:  # the step runs once per microbatch under pp: what it computes itself is per microbatch (README)
        assert len(ours["reduced"]) == 2 * len(ref["reduced"])
    ours, ref = _pair(layout, "lr-monitor-momentum")
    assert [sorted(r) for r in ours["rows"]] == [sorted(r) for r in ref["rows"]]
    assert [r.get("lr-AdamW-momentum") for r in ours["rows"]] == [r.get("lr-AdamW-momentum") for r in ref["rows"]]


def test_model_pruning_is_refused_on_a_split_model_and_matches_ddp_at_dp2():
    assert "ModelPruning with tp=2" in _run("tp2")["pruning"]["error"]
    assert "ModelPruning with tp=1, pp=2" in _run("pp2")["pruning"]["error"]
    _close(*(r["losses"] for r in _pair("dp2", "pruning")))


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_on_exception_checkpoint_resumes_where_the_run_stopped(layout):
    """DDP's own resume restarts the epoch's loader; the strategy's continues as an uninterrupted run."""
    ours, ref = _pair(layout, "on-exception-checkpoint")
    assert ours["raised"] == "user error at step 2" and ours["saved"] and ours["global_step"] == 4
    _close(ours["losses"], ref["straight"])
    assert "OnExceptionCheckpoint with pp=2" in _run("pp2")["on-exception-checkpoint"]["error"]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_throughput_monitor_counts_replicas_not_processes(layout):
    ours, ref = _pair(layout, "throughput")
    assert ours["columns"] == ref["columns"] and ours["replicas"] == ref["replicas"] and ours["samples"] == ref["samples"]
    if layout != "dp2":
        assert _run(layout)["batch-size-finder"]["error"] == _run("ddp")["batch-size-finder"]["error"]


def test_habits_at_tp2_pp2_match_one_device():
    """Both splits at once (4 processes), against the same one-process DDP run as tp2 and pp2."""
    ours, ref = _pair("tp2pp2", "summary")
    assert ours["counts"] == ref["counts"]
    ours, ref = _pair("tp2pp2", "predict-writer")
    assert ours["batch_indices"] == ref["batch_indices"]
    for key in ("returned", "written"):
        assert [len(x) for x in ours[key]] == [len(x) for x in ref[key]]
        _close([v for x in ours[key] for v in x], [v for x in ref[key] for v in x])
    ours, ref = _pair("tp2pp2", "manual-clip")
    _close(ours["losses"], ref["losses"])
    _close(ours["norms"], ref["norms"], tol=1e-4)
    _close(*(r["losses"] for r in _pair("tp2pp2", "no-decay")))
    ours, ref = _pair("tp2pp2", "module-misc")
    _close(ours["losses"], ref["losses"])
    assert ours["estimated_stepping_batches"] == ref["estimated_stepping_batches"]
    assert len(ours["reduced"]) == 2 * len(ref["reduced"])  # per microbatch under pp (README)
    ours, ref = _pair("tp2pp2", "throughput")
    assert ours["columns"] == ref["columns"] and ours["replicas"] == ref["replicas"] and ours["samples"] == ref["samples"]
