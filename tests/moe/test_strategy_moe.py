"""Expert parallelism inside Lightning: the MoE GPT (``--model moe-gpt``: MLPs are
``MoELayer(num_experts=4, top_k=2)``) trained with MegatronStrategy(ep=..., tp=..., pp=...) logs
on rank 0 the same per-step train_loss as Lightning's own DDPStrategy on the dense data-parallel
process count (world / (tp·pp)), within 2e-4; the auxiliary load-balancing loss is in the
gradients of both (injected in backward) and logged as ``moe_aux_loss`` by the strategy.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "tests" / "scripts" / "train.py"
TOL = 2e-4
pytestmark = pytest.mark.slow

LAYOUTS = {  # name: (processes, dense dp, strategy arguments)
    "ep2": (2, 2, ("--ep", "2")),
    "ep4": (4, 4, ("--ep", "4")),
    "tp2-ep2-etp1": (4, 2, ("--tp", "2", "--ep", "2", "--etp", "1", "--user-plan")),
    "pp2-ep2": (4, 2, ("--pp", "2", "--ep", "2")),
}


@lru_cache(maxsize=None)
def _run(strategy: str, nprocs: int, *extra: str) -> dict:
    # 128 samples: 8 steps of batch 4 on each of up to 4 data-parallel replicas (same data for both strategies)
    args = ["--model", "moe-gpt", "--strategy", strategy, "--layers", "2", "--n-train", "128", *extra]
    return run_script(TRAIN, nprocs, args, timeout=600)


def _assert_same_training(ours: dict, ref: dict) -> None:
    assert len(ours["train_loss"]) == len(ref["train_loss"]) > 0
    diff = max(abs(a - b) for a, b in zip(ours["train_loss"], ref["train_loss"]))
    assert diff < TOL, f"train_loss differs by {diff:.2e}: {ours['train_loss']} vs {ref['train_loss']}"
    assert ref["train_loss"][0] != ref["train_loss"][-1], "the reference did not train"
    assert len(ours["val_loss"]) == len(ref["val_loss"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["val_loss"], ref["val_loss"])) < TOL


def _assert_aux_logged(ours: dict) -> None:
    values = [m.get("moe_aux_loss") for m in ours["metrics"]]
    assert all(v is not None for v in values), "the strategy did not log moe_aux_loss"
    # coefficient 1e-2: exactly 1e-2 for perfectly balanced routing, at most E/k = 2x that
    assert all(math.isfinite(v) and 0.009 < v < 0.02 for v in values), values


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_gpt_expert_parallel_matches_ddp(layout):
    nprocs, dp, extra = LAYOUTS[layout]
    ours = _run("megatron", nprocs, *extra)
    _assert_same_training(ours, _run("ddp", dp))
    _assert_aux_logged(ours)


def test_moe_clipping_counts_every_expert_once():
    """SGD with a small clip: only the true global norm (dense + every expert once) matches."""
    extra = ("--clip", "0.05", "--optimizer", "sgd")
    ours = _run("megatron", 4, "--ep", "2", "--tp", "2", "--etp", "1", "--user-plan", *extra)
    ref = _run("ddp", 2, *extra)
    unclipped = _run("ddp", 2, "--optimizer", "sgd")
    assert max(abs(a - b) for a, b in zip(ref["train_loss"], unclipped["train_loss"])) > 5e-3, "clip had no effect"
    _assert_same_training(ours, ref)
