"""PEFT LoRA under tensor parallelism (``layers/lora_plan.py``): adapters on every linear layer
(column and row base layers) train like one device with the frozen base untouched; DoRA and LoRA
with sequence parallelism, which tp cannot reproduce exactly, are refused in setup."""
import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.peft_lora_runs import assert_lora_matches_ddp, meta_lora_llama


@pytest.mark.timeout(500)
def test_lora_llama_trains_like_one_device_with_the_base_frozen_tp2():
    assert_lora_matches_ddp("--tp", "2")


def test_dora_under_tp_is_refused_naming_what_works():
    model = meta_lora_llama(use_dora=True)
    with pytest.raises(MegatronConfigError, match=r"q_proj.*DoRA.*pp and dp.*merge_and_unload"):
        resolve_tp_plan(model, None, 2)


def test_lora_with_sequence_parallel_is_refused_before_any_collective():
    from megastrategy.layers.sequence_parallel import check_sequence_parallel_support

    model = meta_lora_llama()
    with pytest.raises(MegatronConfigError, match=r"sequence_parallel=True with the PEFT LoRA layer .*q_proj.*=False"):
        check_sequence_parallel_support(model)
