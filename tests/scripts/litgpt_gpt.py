"""A LitGPT model (``litgpt.model.GPT``) trained the way Lightning's users write it: the module
holds ``self.model = GPT(Config(...))``, ``training_step`` computes the next-token loss itself with
``F.cross_entropy(logits.view(-1, V), y.view(-1))``. ``--groups`` picks the key/value query groups
(2: GQA, 4: plain multi-head). Launched on N processes by tests/helpers/launch.py; rank 0 writes
the per-step losses and the validation loss to ``--out``.
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
import torch.nn.functional as F  # noqa: E402

from tests.helpers.litgpt_runs import tiny_litgpt  # noqa: E402
from tests.helpers.script_args import fit_and_report, layout_parser  # noqa: E402

VOCAB = 128


class LitGPTModule(L.LightningModule):
    def __init__(self, groups: int, variant: str) -> None:
        super().__init__()
        self.model = tiny_litgpt(groups, variant)

    def _loss(self, batch):
        (ids,) = batch
        x, y = ids[:, :-1], ids[:, 1:]
        logits = self.model(x)
        return F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    parser = layout_parser()
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--variant", default="llama", help="tests/helpers/litgpt_runs.py VARIANTS")
    parser.add_argument("--tp-plan", default=None, help="the strategy's tp_plan as JSON")
    args = parser.parse_args()
    L.seed_everything(0)
    data = torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (64, 17), generator=torch.Generator().manual_seed(0)))
    plan = {"tp_plan": json.loads(args.tp_plan)} if args.tp_plan else {}
    fit_and_report(args, LitGPTModule(args.groups, args.variant), data, max_steps=3, **plan)
