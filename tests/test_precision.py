"""Mixed precision with the strategy, against Lightning's own DDP at the same precision."""
from pathlib import Path

import pytest
import torch
from torch import nn

from megastrategy.precision import adopt_precision_plugin
from tests.helpers.dist import run_distributed
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
BF16_REL_TOL = 1e-2  # bf16 keeps 8 bits of mantissa; TP changes the order of partial sums


@pytest.mark.slow
def test_bf16_mixed_tp2_pp2_matches_ddp():
    args = ["--model", "gpt", "--user-plan", "--layers", "4", "--steps", "6", "--precision", "bf16-mixed"]
    ours = run_script(SCRIPT, 4, args + ["--strategy", "megatron", "--tp", "2", "--pp", "2"], timeout=400)
    ref = run_script(SCRIPT, 1, args + ["--strategy", "ddp"], timeout=400)
    rel = [abs(a - b) / abs(b) for a, b in zip(ours["train_loss"], ref["train_loss"])]
    assert len(rel) == 6 and max(rel) < BF16_REL_TOL, (ours["train_loss"], ref["train_loss"])
    assert ref["train_loss"][-1] < ref["train_loss"][0]


@pytest.mark.slow
def test_bf16_true_tp2_pp2_updates_fp32_main_weights_and_tracks_fp32_ddp():
    """bf16 parameters, fp32 main weights in the optimizer: the losses follow an fp32 run within
    bf16 tolerance, and a resume restores the main weights (they are in the optimizer state)."""
    args = ["--model", "gpt", "--user-plan", "--layers", "4", "--steps", "6"]
    ours = run_script(SCRIPT, 4, args + ["--strategy", "megatron", "--tp", "2", "--pp", "2", "--precision", "bf16-true"],
                      timeout=400)
    fp32 = run_script(SCRIPT, 1, args + ["--strategy", "ddp"], timeout=400)
    assert ours["optimizer"] == "MainParamsOptimizer" and ours["param_dtypes"] == ["torch.bfloat16"]
    rel = [abs(a - b) / abs(b) for a, b in zip(ours["train_loss"], fp32["train_loss"])]
    assert len(rel) == 6 and max(rel) < 2 * BF16_REL_TOL, (ours["train_loss"], fp32["train_loss"])


class _PlainPlugin:  # the part of a Lightning precision plugin the agreement touches
    def __init__(self, scaler):
        self.scaler = scaler

    def _after_closure(self, model, optimizer):
        pass


def _one_rank_overflows(rank, world_size):
    # Lightning runs "16-mixed" as bf16 on CPU, so the GradScaler path is exercised directly.
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    plugin = adopt_precision_plugin(_PlainPlugin(scaler), clip_norm=None, clip_value=None)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(torch.ones(()))  # a real step scales its loss first
    p.grad = torch.full((2,), float("inf") if rank == 1 else 8.0)
    scaler.unscale_(opt)
    plugin._after_closure(None, opt)  # where Lightning calls it: after unscaling, before the step
    scaler.step(opt)
    scaler.update()
    return p.detach().tolist(), scaler.get_scale()


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    for params, scale in run_distributed(_one_rank_overflows, 2):
        assert params == [1.0, 1.0]  # no rank stepped
        assert scale == 4.0  # and every rank halved its scale
