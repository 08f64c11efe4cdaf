"""LoRA fine-tuning with PEFT, as users write it (``get_peft_model`` around a Hugging Face Llama,
the base frozen, the optimizer over the adapters): under pp=2 it trains like one device and leaves
the frozen base untouched (the tp side is in tests/layers/test_lora_plan.py)."""
import pytest

from tests.helpers.peft_lora_runs import assert_lora_matches_ddp


@pytest.mark.timeout(500)
def test_lora_llama_trains_like_one_device_with_the_base_frozen_pp2():
    assert_lora_matches_ddp("--pp", "2")
