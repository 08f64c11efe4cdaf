"""A module that builds its model in ``configure_model()``, Lightning's recipe for large models
(the model does not exist when the strategy is chosen): a Hugging Face Llama causal LM, loss from
``labels=``. Launched on N processes by tests/helpers/launch.py; rank 0 writes the per-step losses
and the validation loss to ``--out``.
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


class LateLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call it again (fit, then validate)
            return
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    args = layout_parser().parse_args()
    L.seed_everything(0)
    data = TensorDataset(torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0)))
    losses = step_losses_callback()
    trainer = short_fit_trainer(args, [losses], max_steps=4)
    trainer.fit(LateLlama(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({"losses": losses.losses, "val_loss": float(trainer.callback_metrics["val_loss"])}))
    leave_without_static_destructors()


if __name__ == "__main__":
    main()
