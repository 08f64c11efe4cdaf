"""A LitGPT model (``litgpt.model.GPT``) trained the way Lightning's users write it: the module
holds ``self.model = GPT(Config(...))``, ``training_step`` computes the next-token loss itself with
``F.cross_entropy(logits.view(-1, V), y.view(-1))``. ``--groups`` picks the key/value query groups
(2: GQA, 4: plain multi-head); a list (``4,2``) trains one independent model per entry side by side
in one module (the loss is their sum, so each model's gradients and AdamW steps are its own), which
lets one launch check several layouts. Launched on N processes by tests/helpers/launch.py; rank 0
writes the per-step losses and the validation loss to ``--out`` (of the first model; each model's
under ``by_groups``).
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
    def __init__(self, groups: list[int], variant: str) -> None:
        super().__init__()
        self.groups = groups
        self.steps: list[list[float]] = []  # each model's training loss per step (several models)
        self.model = tiny_litgpt(groups[0], variant)
        for g in groups[1:]:  # built after the first, so the first model's init is the same alone or not
            self.add_module(f"model_{g}", tiny_litgpt(g, variant))

    def _models(self):
        return [self.model] + [getattr(self, f"model_{g}") for g in self.groups[1:]]

    def _losses(self, batch):
        (ids,) = batch
        x, y = ids[:, :-1], ids[:, 1:]
        return [F.cross_entropy(m(x).view(-1, VOCAB), y.reshape(-1)) for m in self._models()]

    def training_step(self, batch, batch_idx):
        losses = self._losses(batch)
        self.log("train_loss", losses[0])
        if len(losses) == 1:
            return losses[0]
        self.steps.append([float(loss.detach()) for loss in losses])
        return sum(losses)

    def validation_step(self, batch, batch_idx):
        losses = self._losses(batch)
        self.log("val_loss", losses[0])
        for g, loss in zip(self.groups, losses):
            self.log(f"val_loss_{g}", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def by_groups(module: LitGPTModule):
    """The report's ``losses`` and ``val_loss`` of the first model and ``by_groups``: each model's."""
    def extra(trainer):
        if not module.steps:
            return {}
        runs = {str(g): {"losses": [step[i] for step in module.steps],
                         "val_loss": float(trainer.callback_metrics[f"val_loss_{g}"])}
                for i, g in enumerate(module.groups)}
        return {**runs[str(module.groups[0])], "by_groups": runs}
    return extra


if __name__ == "__main__":
    parser = layout_parser()
    parser.add_argument("--groups", default="2", help="key/value groups of each model, comma-separated")
    parser.add_argument("--variant", default="llama", help="tests/helpers/litgpt_runs.py VARIANTS")
    parser.add_argument("--tp-plan", default=None, help="the strategy's tp_plan as JSON")
    args = parser.parse_args()
    L.seed_everything(0)
    data = torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (64, 17), generator=torch.Generator().manual_seed(0)))
    plan = {"tp_plan": json.loads(args.tp_plan)} if args.tp_plan else {}
    module = LitGPTModule([int(g) for g in args.groups.split(",")], args.variant)
    fit_and_report(args, module, data, max_steps=3, extra=by_groups(module), **plan)
