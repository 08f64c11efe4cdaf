"""PEFT LoRA on a user's own model: ``peft.inject_adapter_in_model`` puts adapters on the hand-written
GPT's projections (tests/helpers/models.py), the base is frozen, the user's ``tp_plan`` names the
projections as it would without adapters. Each case of ``--cases`` (``ddp``; ``tp2``, ``tp2-sp``:
sequence parallel) is fitted in turn in one launch; rank 0 writes ``{case: per-step losses}``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.helpers.models import GPT, TokenDataset  # noqa: E402
from tests.helpers.script_args import layout_parser, run_each, short_fit_trainer, step_losses_callback  # noqa: E402

TARGETS = ["q", "v", "proj", "fc", "out"]  # column and row layers of the user's plan


class LoraGPT(GPT):
    """The user's GPT with LoRA adapters injected in place; ``B`` starts random (as after a first
    phase of training) so that every adapter's gradient is tested from the first step."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0), self)
        for name, p in self.named_parameters():
            p.requires_grad_("lora_" in name)
        for name, m in self.named_modules():
            if name.endswith("lora_B.default"):
                torch.nn.init.normal_(m.weight, std=0.1)

    def compute_loss(self, batch):
        """Next-token loss over the whole sequence (16 tokens: sequence parallelism needs an even length)."""
        ids = batch["input_ids"]
        logits = self(ids)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def fit(args, case: str) -> list[float]:
    L.seed_everything(0)
    module, losses = LoraGPT(), step_losses_callback()
    megatron = {"tp_plan": GPT.TP_PLAN, "sequence_parallel": case.endswith("-sp")}
    trainer = short_fit_trainer(args, [losses], max_steps=4, **({} if args.strategy == "ddp" else megatron))
    trainer.limit_val_batches = 0
    trainer.fit(module, DataLoader(TokenDataset(32), batch_size=8))
    return losses.losses


if __name__ == "__main__":
    parser = layout_parser()
    parser.add_argument("--cases", required=True)
    arguments = parser.parse_args()
    run_each(arguments.cases.split(","), lambda case: fit(arguments, case), arguments.out)
