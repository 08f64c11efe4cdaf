"""PEFT LoRA on a user's own model under the user's ``tp_plan`` (``layers/plan/drafts.py``): an entry
naming a projection PEFT wrapped shards its base layer and the adapter half that follows it, as a
declared Hugging Face plan does; with sequence parallelism the whole adapter halves sum their
gradients over tp (``layers/lora_sequence_parallel.py``). Against DDP from the same seed."""
from pathlib import Path

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "user_lora.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lora_on_a_users_gpt_under_its_tp_plan_trains_like_ddp_also_sequence_parallel():
    ref = run_script(SCRIPT, 1, ["--strategy", "ddp", "--cases", "ddp"], timeout=180)["ddp"]
    ours = run_script(SCRIPT, 2, ["--strategy", "megatron", "--tp", "2", "--cases", "tp2,tp2-sp"], timeout=240)
    assert len(ref) == 4
    for case in ("tp2", "tp2-sp"):
        assert isinstance(ours[case], list), ours[case]
        assert max(abs(a - b) for a, b in zip(ours[case], ref)) < 2e-4, (case, ours[case], ref)


def test_dora_named_by_a_users_plan_is_refused_naming_what_works():
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from tests.helpers.models import GPT

    with torch.device("meta"):
        model = GPT()
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q"], use_dora=True), model)
    with pytest.raises(MegatronConfigError, match=r"tp_plan\['blocks.\*.q'\]='column' matches 'blocks.0.q'.*DoRA.*merge_and_unload"):
        resolve_tp_plan(model, GPT.TP_PLAN, 2)
