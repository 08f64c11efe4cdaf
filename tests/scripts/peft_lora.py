"""LoRA fine-tuning as users write it: a Hugging Face Llama wrapped by PEFT's ``get_peft_model``
(adapters on the modules ``--model`` names, e.g. ``q_proj+v_proj``; the base frozen), loss from
``labels=``, an optimizer over the trainable parameters only. Launched on N processes by
tests/helpers/launch.py; rank 0 writes the per-step losses and the validation loss to ``--out``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests.helpers.script_args import (  # noqa: E402
    layout_parser, leave_without_static_destructors, short_fit_trainer, step_losses_callback,
)


class LoraLlama(L.LightningModule):
    def __init__(self, targets: str) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets.split("+"), lora_dropout=0.0)
        self.model = get_peft_model(AutoModelForCausalLM.from_config(config), lora)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def main() -> None:
    parser = layout_parser()
    parser.add_argument("--targets", default="q_proj+v_proj")
    args = parser.parse_args()
    L.seed_everything(0)
    data = TensorDataset(torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0)))
    module = LoraLlama(args.targets)
    losses = step_losses_callback()
    trainer = short_fit_trainer(args, [losses], max_steps=4)
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    trainer.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    held = dict(module.named_parameters())
    base_moved = sum(not torch.equal(held[n], p) for n, p in frozen.items() if n in held)
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({
            "losses": losses.losses, "val_loss": float(trainer.callback_metrics["val_loss"]), "base_moved": base_moved,
            "frozen_held": sum(n in held for n in frozen),
        }))
    leave_without_static_destructors()


if __name__ == "__main__":
    main()
