"""PEFT LoRA under tensor parallelism (``layers/lora_plan.py``): adapters on every linear layer
(column and row base layers) train like one device with the frozen base untouched, also with
sequence parallelism (``layers/lora_sequence_parallel.py``); DoRA, which tp cannot reproduce
exactly, is refused in setup."""
import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.peft_lora_runs import assert_lora_matches_ddp, meta_lora_llama


@pytest.mark.timeout(500)
@pytest.mark.parametrize("sequence_parallel", [(), ("--sequence-parallel",)], ids=["tp2", "tp2-sp"])
def test_lora_llama_trains_like_one_device_with_the_base_frozen(sequence_parallel):
    assert_lora_matches_ddp("--tp", "2", *sequence_parallel)


def test_dora_under_tp_is_refused_naming_what_works():
    model = meta_lora_llama(use_dora=True)
    with pytest.raises(MegatronConfigError, match=r"q_proj.*DoRA.*pp and dp.*merge_and_unload"):
        resolve_tp_plan(model, None, 2)
