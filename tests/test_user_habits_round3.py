"""Lightning habits, round 3, against Lightning's own DDPStrategy (per-step losses within 2e-4).

One launch per layout of tests/scripts/habits_round3.py runs every habit one after another
(tests/helpers/round3_habits.py, a tiny GPT or a BatchNorm conv net), against one DDP launch on the
same global batch: tp2 and pp2 against DDP on one process, dp2 against DDP on two.

* an ``IterableDataset`` sharded the DDP way (by ``trainer.global_rank``) gives a tp2/pp2 replica's
  ranks different data: a warning names the fix; sharded by ``distributed_sampler_kwargs`` it
  matches DDP; read whole on every rank it matches DDP at dp2;
* manual optimization with two optimizers (``toggle_optimizer``, two ``opt.step()`` per batch) at
  tp2 and dp2; refused by name at pp2;
* ``GradientAccumulationScheduler({0: 1, 1: 2})``; ``lr_find``; ``StochasticWeightAveraging`` (also
  checkpointed and resumed: each rank's averaged shards come back to it); an EMA
  (``AveragedModel``) built in ``__init__`` or ``on_fit_start``, checkpointed, resumed (built by
  ``on_load_checkpoint``) and loaded by ``load_from_checkpoint`` in one process: DDP's EMA (2e-6);
* ``ModelCheckpoint(save_last=True, every_n_train_steps=2)`` then ``fit(ckpt_path="last")``: the
  resumed steps equal an uninterrupted run (DDP's own resume restarts the epoch's loader);
* a dict of training loaders, the step running the model once on the joined batches (pp2 too) or
  once per batch (tp2; a second pass through the pipeline in one step is refused by name);
* a BatchNorm conv net at dp2: every rank's running statistics and ``val_loss`` equal DDP's
  (``broadcast_buffers``), with and without gradient accumulation.
"""
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "habits_round3.py"
TOL = 2e-4
pytestmark = pytest.mark.slow

GPT_HABITS = ["accumulation-schedule", "resume-last", "swa", "swa-resume", "ema-init", "ema-fit-start", "ema-saved", "lr-find",
              "iter-global-rank", "iter-sampler-kwargs", "two-optimizers"]
LAUNCHES = {  # layout: (processes, strategy arguments, habits)
    "ddp": (1, ["--strategy", "ddp"], GPT_HABITS + ["dict-loaders", "dict-loaders-joined", "straight-7"]),
    "tp2": (2, ["--strategy", "megatron", "--tp", "2"], GPT_HABITS + ["dict-loaders"]),
    "pp2": (2, ["--strategy", "megatron", "--pp", "2"], GPT_HABITS + ["dict-loaders-joined"]),
    "ddp2": (2, ["--strategy", "ddp", "--dp", "2"], ["iter-unsharded", "two-optimizers", "batch-norm", "batch-norm-accumulate"]),
    "dp2": (2, ["--strategy", "megatron", "--dp", "2"], ["iter-unsharded", "two-optimizers", "batch-norm", "batch-norm-accumulate"]),
}


@lru_cache(maxsize=None)
def _run(layout: str) -> dict:
    nprocs, args, habits = LAUNCHES[layout]
    workdir = tempfile.mkdtemp(prefix="habits3-")
    return run_script(SCRIPT, nprocs, [*args, "--habits", ",".join(habits), "--dir", workdir], timeout=300)


def _same_losses(ours: dict, ref: dict) -> None:
    assert "error" not in ours, ours.get("trace")
    assert len(ours["losses"]) == len(ref["losses"]) > 1, (ours["losses"], ref["losses"])
    diff = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))
    assert diff <= TOL, f"losses differ by {diff:.2e}: {ours['losses']} vs {ref['losses']}"


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("habit", ["accumulation-schedule", "swa", "swa-resume", "ema-init", "ema-fit-start", "ema-saved",
                                   "lr-find", "iter-sampler-kwargs"])
def test_habit_matches_ddp(layout, habit):
    ours, ref = _run(layout)[habit], _run("ddp")[habit]
    _same_losses(ours, ref)
    if "val_after" in ref:  # the averaged weights (SWA's, the EMA's) validated after fit
        assert abs(ours["val_after"][0]["val_loss"] - ref["val_after"][0]["val_loss"]) <= TOL


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_resume_from_last_continues_where_an_uninterrupted_run_would(layout):
    ours, straight = _run(layout)["resume-last"], _run("ddp")["straight-7"]
    _same_losses(ours, straight)
    assert ours["global_step"] == 7 and "last.ckpt" in ours["files"]
    assert _run("ddp")["resume-last"]["losses"][:4] == pytest.approx(ours["losses"][:4], abs=TOL)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_an_iterable_dataset_sharded_by_global_rank_is_warned_about(layout):
    warned = _run(layout)["iter-global-rank"]["warnings"]
    assert len(warned) == 1 and "distributed_sampler_kwargs" in warned[0] and "ranks [1]" in warned[0]
    assert not _run(layout)["iter-sampler-kwargs"]["warnings"]


def _ema_weights(path: str) -> dict:
    """The EMA in a checkpoint as ``EmaGPT.load_from_checkpoint`` gives it in this (one) process."""
    import megastrategy  # noqa: F401 - reads a megastrategy checkpoint directory
    from tests.helpers.round3_habits import EmaGPT

    return {k: v for k, v in EmaGPT.load_from_checkpoint(path, when="fit_start").state_dict().items() if k.startswith("ema.")}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("which", ["ckpt", "resumed_ckpt"])
def test_an_ema_in_a_checkpoint_loads_in_one_process_as_ddps(layout, which):
    """Saved after 2 steps, and again after resuming to step 4 (the EMA continued from the checkpoint)."""
    ours, ref = _ema_weights(_run(layout)["ema-saved"][which]), _ema_weights(_run("ddp")["ema-saved"][which])
    assert sorted(ours) == sorted(ref) and len(ref) > 10
    for key, value in ref.items():
        assert ours[key].shape == value.shape and (ours[key] - value).abs().max() <= 2e-6, key


def test_two_optimizers_match_ddp_at_tp2_and_dp2_and_are_refused_at_pp2():
    _same_losses(_run("tp2")["two-optimizers"], _run("ddp")["two-optimizers"])
    _same_losses(_run("dp2")["two-optimizers"], _run("ddp2")["two-optimizers"])
    assert "automatic_optimization=False with pp=2" in _run("pp2")["two-optimizers"]["error"]


def test_dict_of_training_loaders():
    _same_losses(_run("tp2")["dict-loaders"], _run("ddp")["dict-loaders"])
    _same_losses(_run("pp2")["dict-loaders-joined"], _run("ddp")["dict-loaders-joined"])


@pytest.mark.parametrize("habit", ["iter-unsharded", "batch-norm", "batch-norm-accumulate"])
def test_data_parallel_habits_match_ddp_on_two_processes(habit):
    ours, ref = _run("dp2")[habit], _run("ddp2")[habit]
    _same_losses(ours, ref)
    if "buffers" in ref:  # every rank's running statistics: rank 0's, broadcast as DDP does
        for rank, (mine, theirs) in enumerate(zip(ours["buffers"], ref["buffers"])):
            for name, values in theirs.items():
                assert mine[name] == pytest.approx(values, abs=1e-6), (rank, name)
        assert abs(ours["val_loss"] - ref["val_loss"]) <= 1e-6
