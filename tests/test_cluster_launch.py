"""Launched as on a cluster: two ``torchrun`` "nodes" on one host, and SLURM's variables (what
``srun`` sets per task), each tp2·dp2 on 4 processes against DDP on 2 with the same seed.

Both also check what Lightning's cluster environment made of the job (world size, this rank's
TP and DP groups), and the torchrun run that the strategy's layout line appears once in the job.
"""
import importlib.util

import pytest

from tests.helpers.launch import run_script, run_torchrun_nodes
from tests.test_strategy_tp import SCRIPT, _assert_same_training

pytestmark = pytest.mark.slow
TP2_DP2 = ["--model", "encoder", "--strategy", "megatron", "--tp", "2", "--num-nodes", "2"]
LAYOUT = {"world_size": 4, "tp": 2, "dp": 2, "groups": {"tp": [0, 1], "dp": [0, 2]}}


def _ddp_on_2() -> dict:
    return run_script(SCRIPT, 2, ["--model", "encoder", "--strategy", "ddp"])


@pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None, reason="torchrun is not available")
def test_torchrun_two_nodes_tp2_dp2_trains_like_ddp_and_logs_the_layout_once():
    ours, outputs = run_torchrun_nodes(SCRIPT, nnodes=2, nproc_per_node=2, args=[*TP2_DP2, "--log-level", "INFO"])
    assert (ours["environment"], ours["layout"]) == ("TorchElasticEnvironment", LAYOUT)
    _assert_same_training(ours, _ddp_on_2())
    layout_lines = [line for out in outputs for line in out.splitlines() if "megastrategy: 4 processes as" in line]
    assert layout_lines == ["megastrategy.strategy: megastrategy: 4 processes as tp=2 pp=1 dp=2 cp=1 ep=1 "
                            "(order tp-cp-ep-dp-pp)"], "\n".join(outputs)


def test_slurm_variables_two_nodes_tp2_dp2_trains_like_ddp():
    ours = run_script(SCRIPT, 4, [*TP2_DP2, "--slurm"])
    assert (ours["environment"], ours["layout"]) == ("SLURMEnvironment", LAYOUT)
    _assert_same_training(ours, _ddp_on_2())
