"""A module that builds its model in ``configure_model()``, Lightning's recipe for large models
(the model does not exist when the strategy is chosen): a Hugging Face Llama causal LM, loss from
``labels=``. Launched on N processes by tests/helpers/launch.py; rank 0 writes the per-step losses
and the validation loss to ``--out``.
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


class LateLlama(CausalLMSteps):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call it again (fit, then validate)
            return
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(tiny_llama_config())


if __name__ == "__main__":
    args = layout_parser().parse_args()
    L.seed_everything(0)
    fit_and_report(args, LateLlama(), random_token_rows(), max_steps=4)
