"""LoRA fine-tuning as users write it: a Hugging Face Llama wrapped by PEFT's ``get_peft_model``
(adapters on the modules ``--model`` names, e.g. ``q_proj+v_proj``; the base frozen), loss from
``labels=``, an optimizer over the trainable parameters only. Launched on N processes by
tests/helpers/launch.py; rank 0 writes the per-step losses and the validation loss to ``--out``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from tests.helpers.causal_lm_steps import CausalLMSteps, random_token_rows, tiny_llama_config  # noqa: E402
from tests.helpers.script_args import fit_and_report, layout_parser  # noqa: E402


class LoraLlama(CausalLMSteps):
    def __init__(self, targets: str) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets.split("+"), lora_dropout=0.0)
        self.model = get_peft_model(AutoModelForCausalLM.from_config(tiny_llama_config()), lora)
        self.frozen_at_start: dict = {}

    def on_train_start(self) -> None:
        """The frozen parameters this rank holds once the strategy has cut and sharded the model."""
        self.frozen_at_start = {n: p.detach().clone() for n, p in self.named_parameters() if not p.requires_grad}

    def frozen_report(self, trainer: L.Trainer) -> dict:
        """How many frozen parameters this rank holds, how many of them training moved, and each trained
        adapter weight's shape and sum of squares (the test compares those tp leaves whole)."""
        held = dict(self.named_parameters())
        moved = sum(not torch.equal(held[n], p) for n, p in self.frozen_at_start.items())
        adapters = {n: [list(p.shape), float(p.detach().double().square().sum())]
                    for n, p in held.items() if p.requires_grad}
        return {"base_moved": moved, "frozen_held": len(self.frozen_at_start), "adapters": adapters}


if __name__ == "__main__":
    parser = layout_parser()
    parser.add_argument("--targets", default="q_proj+v_proj")
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    L.seed_everything(0)
    module = LoraLlama(args.targets)
    megatron = {"sequence_parallel": True} if args.sequence_parallel else {}
    fit_and_report(args, module, random_token_rows(), max_steps=4, extra=module.frozen_report, **megatron)
