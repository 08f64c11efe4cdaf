"""Lightning's collectives under the strategy mean what they mean under DDP (over replicas, every
rank agreeing): ModelCheckpoint keeps DDP's best epoch, all_gather sees each example once."""
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "collectives.py"


@pytest.fixture(scope="module")
def ddp():
    return run_script(SCRIPT, 2, ["--strategy", "ddp", "--gather"], timeout=300)


@pytest.mark.parametrize("layout", [["--tp", "2", "--gather"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_model_checkpoint_keeps_the_same_best_as_ddp(ddp, layout):
    ours = run_script(SCRIPT, 2, ["--strategy", "megatron", *layout], timeout=300)
    assert ddp["best"] == "epoch=2.ckpt" and ddp["best_score"] == 2.0
    assert ours["best"] == ddp["best"] and ours["best_score"] == ddp["best_score"]


def test_all_gather_sees_every_example_once_at_tp2(ddp):
    ours = run_script(SCRIPT, 2, ["--strategy", "megatron", "--tp", "2", "--gather"], timeout=300)
    assert ddp["gathered"] == [16, 16, 16]
    assert ours["gathered"] == ddp["gathered"]
