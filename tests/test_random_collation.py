"""Random collation behaves as under DDP: an MLM collator (random masking in ``collate_fn``,
``BatchEncoding`` batches) in the main process and in worker processes gives DDP's per-step
losses (and a per-step LR schedule) at tp=2 and pp=2, because every rank of a model replica trains on the same masked batch
and the strategy draws nothing from the user's random streams.

Under pp the batch of 8 runs as 4 microbatches holding different numbers of masked tokens: the
MLM loss is still one device's mean over the batch's masked tokens
(:mod:`megastrategy.pipeline.token_means`; the mean of the microbatch means was 9e-3 off).
"""
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parent / "scripts" / "mlm_collation.py"
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("workers", [0, 2], ids=["main-process", "2-workers"])
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--microbatches", "4"]], ids=["tp2", "pp2"])
def test_mlm_collator_gives_ddp_losses(layout, workers):
    ddp = run_script(SCRIPT, 1, ["--strategy", "ddp", "--num-workers", str(workers)], timeout=300)
    ours = run_script(SCRIPT, 2, ["--strategy", "megatron", *layout, "--num-workers", str(workers)], timeout=300)
    assert len(ddp["losses"]) == 6
    assert ours["losses"] == pytest.approx(ddp["losses"], abs=2e-4)
    assert ours["lrs"] == ddp["lrs"] and ddp["lrs"][0] < ddp["lrs"][-1]  # the per-step schedule ran
