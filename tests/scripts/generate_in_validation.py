"""Greedy ``model.generate()`` in ``validation_step``, the way users score a causal LM on its
continuations, beside the usual teacher-forced loss. Launched on N processes by
tests/helpers/launch.py; rank 0 writes the losses and every continuation it generated to ``--out``.
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


class GeneratingLlama(CausalLMSteps):
    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(tiny_llama_config())
        self.continuations: list = []

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        prompt = batch[0][:, :8]
        out = self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                  do_sample=False, pad_token_id=0)
        self.continuations.append(out[:, 8:].tolist())


if __name__ == "__main__":
    args = layout_parser().parse_args()
    L.seed_everything(0)
    module = GeneratingLlama()
    fit_and_report(args, module, random_token_rows(), max_steps=2, extra=lambda trainer: {"continuations": module.continuations})
