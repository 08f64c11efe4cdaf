"""LoRA fine-tuning with PEFT, as users write it (``get_peft_model`` around a Hugging Face Llama,
the base frozen, the optimizer over the adapters): under pp=2 it trains like one device and leaves
the frozen base untouched; under tp it is refused in setup with what works instead."""
from pathlib import Path

import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peft_lora.py"


@pytest.mark.timeout(400)
def test_lora_llama_trains_at_pp2_like_one_device_with_the_base_frozen():
    reference = run_script(SCRIPT, 1, ["--strategy", "ddp"], timeout=180)
    pp2 = run_script(SCRIPT, 2, ["--strategy", "megatron", "--pp", "2"], timeout=180)
    assert len(pp2["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(pp2["losses"], reference["losses"])) < 2e-4
    assert abs(pp2["val_loss"] - reference["val_loss"]) < 2e-4
    assert pp2["frozen_held"] > 0 and pp2["base_moved"] == 0 == reference["base_moved"]


def test_lora_under_tp_is_refused_naming_what_works():
    import peft  # a dev dependency
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(MegatronConfigError, match=r"q_proj.*PEFT LoRA layer.*pp and dp.*merge_and_unload"):
        resolve_tp_plan(model, None, 2)
