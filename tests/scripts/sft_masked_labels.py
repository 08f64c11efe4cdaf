"""Supervised fine-tuning as users write it: a Hugging Face Llama causal LM whose labels are the
input ids with the prompt (a different length per example) and the right padding set to -100, so
the loss is a mean over a different number of tokens in each example. The batch is a dict from
the collator; the step passes ``labels=`` and logs ``train_loss`` / ``val_loss``. Launched on N
processes by tests/helpers/launch.py; rank 0 writes the per-step losses and the validation loss.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from tests.helpers.causal_lm_steps import CausalLMSteps, tiny_llama_config  # noqa: E402
from tests.helpers.script_args import fit_and_report, layout_parser  # noqa: E402


class PromptMaskedRows(torch.utils.data.Dataset):
    """Rows of 16 tokens: a prompt of 2-12 tokens and an answer, right-padded with 0 after it."""

    def __init__(self, rows: int = 64, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (rows, length), generator=g)
        self.labels = self.ids.clone()
        prompts = torch.randint(2, 12, (rows,), generator=g)
        ends = torch.clamp(prompts + torch.randint(1, 8, (rows,), generator=g), max=length)
        for row, (prompt, end) in enumerate(zip(prompts.tolist(), ends.tolist())):
            self.labels[row, :prompt] = -100
            self.ids[row, end:] = 0
            self.labels[row, end:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Finetune(CausalLMSteps):
    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(tiny_llama_config())

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)


if __name__ == "__main__":
    parser = layout_parser()
    parser.add_argument("--microbatches", type=int, default=None)
    args = parser.parse_args()
    L.seed_everything(0)
    megatron = {"num_microbatches": args.microbatches} if args.microbatches else {}
    fit_and_report(args, Finetune(), PromptMaskedRows(), max_steps=4, **megatron)
