"""One DDP reference run of the PEFT LoRA Llama, shared by the tp (tests/layers) and pp
(tests/pipeline) comparisons, and the meta-device LoRA model the setup refusals are checked on."""
from functools import lru_cache
from pathlib import Path

import torch

from tests.helpers.causal_lm_steps import tiny_llama_config
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peft_lora.py"
EVERY_LINEAR = "q_proj+k_proj+v_proj+o_proj+gate_proj+up_proj+down_proj"  # column and row base layers


@lru_cache(maxsize=None)
def lora_run(nprocs: int, *args: str) -> dict:
    """The script's report (per-step losses, val_loss, frozen-base checks) for LoRA on every linear layer."""
    return run_script(SCRIPT, nprocs, [*args, "--targets", EVERY_LINEAR], timeout=180)


def assert_lora_matches_ddp(*layout: str) -> None:
    reference, ours = lora_run(1, "--strategy", "ddp"), lora_run(2, "--strategy", "megatron", *layout)
    assert len(ours["losses"]) == 4  # the adapters' B starts at zero: steps 2-4 test the adapter path
    assert max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"])) < 2e-4
    assert abs(ours["val_loss"] - reference["val_loss"]) < 2e-4
    assert ours["frozen_held"] > 0 and ours["base_moved"] == 0 == reference["base_moved"]
    _assert_whole_adapters_match(ours["adapters"], reference["adapters"])


def _assert_whole_adapters_match(ours: dict, reference: dict) -> None:
    """The trained adapter weights every rank holds whole (``A`` of column layers, ``B`` of row layers; all
    of them under pp) equal one device's: a gradient summed over the wrong ranks moves them apart."""
    whole = [n for n, (shape, _) in ours.items() if reference[n][0] == shape]
    assert len(whole) >= 7, whole  # one per targeted linear layer of a block at least
    for n in whole:
        assert abs(ours[n][1] - reference[n][1]) <= 1e-4 * max(1.0, reference[n][1]), (n, ours[n], reference[n])


def meta_lora_llama(**lora):
    import peft  # a dev dependency
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **lora))
