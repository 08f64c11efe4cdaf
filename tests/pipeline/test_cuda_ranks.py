"""The tutorial module's multi-rank paths with CUDA tensors: every rank on one GPU, over gloo.

NCCL refuses two ranks on one GPU, so a one-GPU machine cannot run NCCL between ranks; gloo
can move CUDA tensors for the collectives it implements on them. What this proves on a real GPU
that the CPU runs cannot: batches, activations, relayed model outputs, logged values and
torchmetrics states live on the module's CUDA device in every stage and match DDP on the same
GPU. What it leaves untested is NCCL itself between two GPUs (docs/gpu.md).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_script
from tests.pipeline.test_output_relay import _assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: checks CUDA tensors across ranks"),
]

SCRIPT = Path(__file__).parents[1] / "scripts" / "tutorial_module.py"
LAYOUTS = {  # name: (processes, DDP processes with the same data-parallel size, strategy arguments)
    "tp2": (2, 1, ("--tp", "2")),
    "pp2": (2, 1, ("--pp", "2")),
    "tp2-pp2": (4, 1, ("--tp", "2", "--pp", "2")),
}


@lru_cache(maxsize=None)
def _run(nprocs: int, *args: str) -> dict:
    return run_script(SCRIPT, nprocs, [*args, "--device", "cuda"], timeout=300)["ranks"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_ranks_match_ddp_with_every_logged_value_on_the_gpu(layout):
    nprocs, ddp_procs, args = LAYOUTS[layout]
    ours, ddp = _run(nprocs, "--strategy", "megatron", *args), _run(ddp_procs, "--strategy", "ddp")
    assert {"val_loss", "accuracy", "tm_accuracy", "train_loss"} <= ddp[0]["metric_devices"][-1].keys()
    for rank, rec in enumerate(ours):
        reference = ddp[rec["replica"]]
        _assert_close(rec["epoch_metrics"], reference["epoch_metrics"], f"rank {rank} epoch metrics")
        _assert_close(rec["train_metrics"], reference["train_metrics"], f"rank {rank} step metrics")
        _assert_close(rec["val_outputs"], reference["val_outputs"], f"rank {rank} validation outputs")
        assert rec["gathered"] == reference["gathered"], f"rank {rank} all_gather"
        devices = {d for metrics in rec["metric_devices"] for d in metrics.values()}
        assert devices == {"cuda:0"}, f"rank {rank}: logged values on {devices}"
