"""A timm Vision Transformer (``timm.create_model("vit_tiny_patch16_224", ...)`` made tiny) trained
the way Lightning's users write it: ``self.model`` holds it, ``training_step`` computes
``F.cross_entropy(self.model(x), y)``. Launched on N processes by tests/helpers/launch.py; rank 0
writes the per-step losses and the validation loss to ``--out``.
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

from tests.helpers.script_args import fit_and_report, layout_parser  # noqa: E402
from tests.helpers.timm_runs import tiny_vit  # noqa: E402


class ViTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_vit()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    args = layout_parser().parse_args()
    L.seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    images, labels = torch.randn(64, 3, 32, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    data = torch.utils.data.TensorDataset(images, labels)
    fit_and_report(args, ViTModule(), data, max_steps=3)
