"""A loss averaged over a data-dependent number of tokens trains under pp as on one device.

Supervised fine-tuning with the prompt and the padding labelled -100 (tests/scripts/sft_masked_labels.py):
each microbatch holds a different number of answer tokens, so the mean of the microbatch means
is not the batch's mean (3e-2 off before :mod:`megastrategy.pipeline.token_means`). The masked
LM case (an MLM collator, random masks) is in tests/test_random_collation.py.
"""
from pathlib import Path

import pytest

from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "sft_masked_labels.py"


@pytest.mark.parametrize("nprocs, layout", [
    (2, ["--pp", "2", "--microbatches", "4"]),
    (2, ["--pp", "2", "--vp", "2", "--microbatches", "4"]),
    (4, ["--tp", "2", "--pp", "2", "--microbatches", "4"]),  # the loss over vocab-parallel logits
], ids=["pp2", "pp2-vp2", "tp2-pp2"])
def test_prompt_masked_fine_tuning_under_pp_gives_one_devices_losses(nprocs, layout):
    ddp = run_script(SCRIPT, 1, ["--strategy", "ddp"], timeout=300)
    ours = run_script(SCRIPT, nprocs, ["--strategy", "megatron", *layout], timeout=300)
    assert len(ddp["losses"]) == 4
    assert ours["losses"] == pytest.approx(ddp["losses"], abs=2e-4)
    assert ours["val_loss"] == pytest.approx(ddp["val_loss"], abs=2e-4)
