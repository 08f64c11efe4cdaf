"""LoRA fine-tuning with PEFT, as users write it (``get_peft_model`` around a Hugging Face Llama,
the base frozen, the optimizer over the adapters): under pp=2 and tp=2 it trains like one device
and leaves the frozen base untouched; DoRA, which tp cannot shard exactly, is refused in setup."""
from pathlib import Path

import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.causal_lm_steps import tiny_llama_config
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peft_lora.py"
EVERY_LINEAR = "q_proj+k_proj+v_proj+o_proj+gate_proj+up_proj+down_proj"  # column and row base layers


@pytest.mark.timeout(500)
@pytest.mark.parametrize("layout, targets", [(("--pp", "2"), "q_proj+v_proj"), (("--tp", "2"), EVERY_LINEAR)],
                         ids=["pp2", "tp2"])
def test_lora_llama_trains_like_one_device_with_the_base_frozen(layout, targets):
    reference = run_script(SCRIPT, 1, ["--strategy", "ddp", "--targets", targets], timeout=180)
    ours = run_script(SCRIPT, 2, ["--strategy", "megatron", *layout, "--targets", targets], timeout=180)
    assert len(ours["losses"]) == 4  # the adapters' B starts at zero: steps 2-4 test the adapter path
    assert max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"])) < 2e-4
    assert abs(ours["val_loss"] - reference["val_loss"]) < 2e-4
    assert ours["frozen_held"] > 0 and ours["base_moved"] == 0 == reference["base_moved"]


def _meta_lora_llama(**lora):
    import peft  # a dev dependency
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **lora))


def test_dora_under_tp_is_refused_naming_what_works():
    model = _meta_lora_llama(use_dora=True)
    with pytest.raises(MegatronConfigError, match=r"q_proj.*DoRA.*pp and dp.*merge_and_unload"):
        resolve_tp_plan(model, None, 2)


def test_lora_with_sequence_parallel_is_refused_before_any_collective():
    from megastrategy.layers.sequence_parallel import check_sequence_parallel_support

    model = _meta_lora_llama()
    with pytest.raises(MegatronConfigError, match=r"sequence_parallel=True with the PEFT LoRA layer .*q_proj.*=False"):
        check_sequence_parallel_support(model)
