"""Lightning's own demo language model (``lightning.pytorch.demos.transformer.Transformer``: an
``nn.Transformer`` encoder-decoder, the target embedded before the encoder runs) in the module
Lightning's docs wrap it in, on random tokens. Launched on N processes by tests/helpers/launch.py;
rank 0 writes the per-step losses and the validation loss to ``--out``.
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
from lightning.pytorch.demos.transformer import Transformer  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from tests.helpers.script_args import fit_and_report, layout_parser  # noqa: E402

VOCAB, SEQ = 50, 16


class LightningTransformer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def forward(self, inputs, target):
        return self.model(inputs, target)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = F.nll_loss(self(inputs, target), target.view(-1))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        self.log("val_loss", F.nll_loss(self(inputs, target), target.view(-1)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


if __name__ == "__main__":
    args = layout_parser().parse_args()
    L.seed_everything(0)
    ids = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(0))
    fit_and_report(args, LightningTransformer(), TensorDataset(ids[:, :-1], ids[:, 1:]), max_steps=3)
