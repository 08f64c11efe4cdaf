"""``megastrategy check``: the report's verdict, the worker's helpers, and the command on real processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from megastrategy.config import MegatronConfigError
from megastrategy.parity import ParityRun, compare_runs, run_check
from megastrategy.parity.launch import RanksFailed, launch_ranks
from megastrategy.parity.worker import import_object, silence_dropout

REPO = Path(__file__).resolve().parents[2]


def _report(losses, grad_norms, tolerance=2e-4):
    ref = {"losses": [1.0, 0.9], "grad_norms": [2.0, 1.5]}
    return compare_runs(ref, {"losses": losses, "grad_norms": grad_norms}, layout="tp=2", reference_name="DDP",
                        tolerance=tolerance)


def test_equal_runs_pass_and_the_table_lists_every_step():
    report = _report([1.0 + 1e-5, 0.9], [2.0, 1.5 * (1 + 1e-6)])
    assert report.passed
    text = report.format()
    assert text.splitlines()[-1].startswith("PASS") and len(text.splitlines()) == 5


def test_a_loss_or_grad_norm_beyond_the_tolerance_fails():
    assert not _report([1.0, 0.9 + 3e-4], [2.0, 1.5]).passed
    assert not _report([1.0, 0.9], [2.0, 1.5 * 1.01]).passed  # gradient norms compare relatively
    assert _report([1.0, 0.9 + 3e-4], [2.0, 1.5], tolerance=1e-3).passed


def test_a_run_that_recorded_fewer_steps_fails_and_says_so():
    report = _report([1.0], [2.0])
    assert not report.passed and "steps recorded: reference 2, layout 1" in report.format()


def test_silence_dropout_zeroes_modules_and_hugging_face_float_rates():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_dropout = 0.1  # what HF attention passes to F.dropout
            self.drop = nn.Dropout(0.2)

    model = nn.Sequential(Attention(), nn.Dropout(0.0))
    assert silence_dropout(model) == 2
    assert model[0].attention_dropout == 0.0 and model[0].drop.p == 0.0


def test_import_paths_resolve_and_a_bare_name_is_refused():
    assert import_object("megastrategy.parity:ParityRun") is ParityRun
    assert import_object("megastrategy.parity.ParityRun") is ParityRun
    with pytest.raises(ValueError, match="package.module:ClassName"):
        import_object("ParityRun")


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="steps=0"):
        ParityRun(module="a.b:C", steps=0)
    with pytest.raises(MegatronConfigError, match="not divisible"):
        run_check(ParityRun(module="a.b:C"), {"tp": 2}, devices=3)


def test_a_failing_rank_stops_the_launch_with_its_output():
    with pytest.raises(RanksFailed, match="rank 1 exited with code 3") as info:
        launch_ranks(["-c", "import os,sys; print('hello from', os.environ['RANK']); sys.exit(int(os.environ['RANK']) * 3)"],
                     2, timeout=60)
    assert "hello from 1" in str(info.value)


def test_a_hanging_rank_is_stopped_at_the_timeout():
    with pytest.raises(RanksFailed, match="timed out"):
        launch_ranks(["-c", "import time; time.sleep(60)"], 1, timeout=2)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]))
    return subprocess.run([sys.executable, "-m", "megastrategy.cli", "check", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_check_passes_a_hugging_face_bert_at_tp2():
    done = _cli("tests.helpers.models:BertClassifier", "--devices", "2", "--tp", "2", "--steps", "3",
                "--module-args", '{"n_train": 24}')
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "against DDPStrategy on 1 process(es)" in done.stdout


@pytest.mark.slow
def test_check_fails_a_summed_loss_under_pipeline_microbatches():
    # reduction="sum": each of the 2 microbatches sums over half the batch, so the layout's loss
    # is about half of one device's. The check must say FAIL and exit 1.
    done = _cli("tests.helpers.models:BertSummedLoss", "--devices", "2", "--pp", "2", "--steps", "2",
                "--module-args", '{"n_train": 16}')
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("FAIL")
    # the training run itself says why (a warning on rank 0, shown by the check above its verdict)
    assert "the layout's run warned: megastrategy: training_step calls F.cross_entropy(..., reduction='sum') under " \
           "pipeline parallelism with 2 microbatches" in done.stdout, done.stdout


@pytest.mark.slow
def test_a_module_that_cannot_be_imported_gives_exit_code_2_and_the_ranks_output():
    done = _cli("tests.helpers.models:NoSuchModule", "--devices", "1", "--steps", "1", "--timeout", "120")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no verdict" in done.stderr and "NoSuchModule" in done.stderr
