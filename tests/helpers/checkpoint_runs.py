"""Training runs that write checkpoints, shared by the checkpoint tests (each runs once per session).

Uninterrupted runs of 2 epochs (n_train=16, batch 4, dp=1: 4 steps per epoch) in which
ModelCheckpoint saves at every epoch end: their losses are the reference and their epoch-0
checkpoint is what the resume tests start from.

Runs stop by ``--epochs`` (``max_epochs``), not ``max_steps``: Lightning treats ``max_steps``
training as "iteration based" and resumes even an epoch-end checkpoint as mid-epoch, which
replays the data in a different order (a Lightning behaviour; plain DDP shows it too).
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
GPT = ["--model", "gpt", "--strategy", "megatron", "--user-plan", "--layers", "4", "--n-train", "16", "--no-val"]
BERT = ["--model", "bert", "--strategy", "megatron", "--layers", "2", "--n-train", "16", "--no-val"]
EPOCH0 = "epoch=0-step=4.ckpt"


def _tmpdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.lru_cache(maxsize=None)
def gpt_tp2_pp2() -> tuple[dict, Path]:
    """GPT (tied head, user plan, 4 layers) on tp=2, pp=2: (result, checkpoint folder).

    After fit, ``result["test_ckpt"]`` is the test loss of the epoch-0 checkpoint.
    """
    folder = _tmpdir("megastrategy-gpt-tp2pp2-")
    args = ["--tp", "2", "--pp", "2", "--epochs", "2", "--ckpt-dir", str(folder), "--test-ckpt", str(folder / EPOCH0)]
    result = run_script(SCRIPT, 4, GPT + args, timeout=400)
    return result, folder


@functools.lru_cache(maxsize=None)
def bert_tp2() -> tuple[dict, Path]:
    """Hugging Face BertForSequenceClassification (vocab 101) on tp=2: (result, checkpoint folder).

    After fit the run also exports the model with ``strategy.export_hf`` into ``folder / "hf"``."""
    folder = _tmpdir("megastrategy-bert-tp2-")
    args = ["--tp", "2", "--epochs", "2", "--ckpt-dir", str(folder), "--export-hf", str(folder / "hf")]
    result = run_script(SCRIPT, 2, BERT + args, timeout=400)
    return result, folder


#: BERT classifier, dropout off, 64 examples in batches of 4 (16 per epoch at dp=1), 6 steps,
#: every rank's example ids recorded
MID_EPOCH_BERT = ["--model", "bert", "--strategy", "megatron", "--layers", "2", "--n-train", "64", "--steps", "6",
                  "--no-val", "--log-ids", "--heartbeat-timeout", "10"]
MID_EPOCH = "epoch=0-step=3.ckpt"


@functools.lru_cache(maxsize=None)
def mid_epoch_bert_run(layout: tuple[str, ...], nprocs: int) -> tuple[dict, Path]:
    """6 uninterrupted steps on ``layout`` that save a checkpoint after step 3: (result, that checkpoint)."""
    folder = _tmpdir("megastrategy-mid-epoch-")
    args = [*MID_EPOCH_BERT, *layout, "--ckpt-dir", str(folder), "--ckpt-every", "3"]
    result = run_script(SCRIPT, nprocs, args, timeout=400)
    return result, folder / MID_EPOCH
