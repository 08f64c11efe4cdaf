"""Launches of tests/scripts/user_habits.py shared by the user-habit tests (each runs once per session).

Every run trains ``HabitBert`` (tests/helpers/habit_model.py) 13 steps (6 per epoch: ``max_steps``
stops mid-epoch 2, validation every half epoch on two loaders) and keeps the best checkpoint by
``val_loss``; Lightning's ``DDPStrategy`` on as many processes as the layout has data-parallel
replicas is the reference for each set of habits.
"""
from __future__ import annotations

import functools
from pathlib import Path

from tests.helpers.checkpoint_runs import _tmpdir
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "user_habits.py"

#: fine-tuning: frozen embeddings, ReduceLROnPlateau on val_loss, clipping by value
FROZEN_EMBEDDINGS = ("--freeze-embeddings", "--scheduler", "plateau", "--clip", "value")
#: embeddings and the first two encoder layers frozen (at pp2 the whole first stage), the optimizer
#: over all parameters (what the frozen-stage error proposes), OneCycleLR, clipping by norm
FROZEN_LAYERS = ("--freeze-embeddings", "--freeze-layers", "2", "--all-params", "--scheduler", "onecycle",
                 "--clip", "norm")
#: two parameter groups, linear warm-up, trainer.validate before fit, fit twice on one Trainer
REFIT = ("--param-groups", "--scheduler", "linear", "--validate-first", "--fit-twice")
#: the whole first stage frozen (embeddings, layers 0-1) and the optimizer over the trainable ones
FROZEN_FIRST_STAGE = ("--freeze-embeddings", "--freeze-layers", "2")

LAYOUTS = {"ddp": (1, ("--strategy", "ddp")), "tp2": (2, ("--strategy", "megatron", "--tp", "2")),
           "pp2": (2, ("--strategy", "megatron", "--pp", "2")), "ddp2": (2, ("--strategy", "ddp")),
           "dp2-zero": (2, ("--strategy", "megatron", "--zero"))}  # the distributed optimizer needs dp > 1


@functools.lru_cache(maxsize=None)
def habit_run(layout: str, habits: tuple[str, ...]) -> tuple[dict, Path]:
    """``(result, folder)``: what rank 0 wrote, and the folder with ``csv/`` and ``ckpt/``."""
    nprocs, args = LAYOUTS[layout]
    folder = _tmpdir(f"megastrategy-habits-{layout}-")
    return run_script(SCRIPT, nprocs, [*args, "--dir", str(folder), *habits], timeout=240), folder
