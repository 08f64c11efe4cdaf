"""Lightning's collectives as a user meets them: ModelCheckpoint(monitor) keeps the best epoch,
and ``self.all_gather`` at epoch end sees every validation example once.

Launched on N processes by tests/helpers/launch.py; rank 0 writes what it saw to ``--out``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from tests.helpers.models import GPT  # noqa: E402
from tests.helpers.script_args import layout_parser  # noqa: E402


class GatheringGPT(GPT):
    """Appends each validation batch's loss in the step; gathers them and logs a score at epoch end."""

    def __init__(self, gather: bool, **kw):
        super().__init__(**kw)
        self.gather = gather
        self.outputs: list[torch.Tensor] = []
        self.gathered: list[int] = []

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.outputs.append(batch["input_ids"][:, 0].float())  # one value per example
        return loss

    def on_validation_epoch_end(self):
        if self.gather:
            self.gathered.append(int(self.all_gather(torch.cat(self.outputs)).numel()))
        self.outputs.clear()
        self.log("score", float(self.current_epoch))  # improves every epoch


def main() -> None:
    p = layout_parser()
    p.add_argument("--gather", action="store_true", help="all_gather the validation outputs at epoch end")
    args = p.parse_args()
    L.seed_everything(0)
    module = GatheringGPT(args.gather, n_layer=2, n_train=16, n_val=16)
    if args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=args.tp, pp=args.pp, tp_plan=GPT.TP_PLAN if args.tp > 1 else None)
    dirpath = Path(tempfile.mkdtemp(prefix="megastrategy-best-"))
    checkpoint = ModelCheckpoint(dirpath=dirpath, monitor="score", mode="max", save_top_k=1, filename="{epoch}")
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=3,
        callbacks=[checkpoint], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_train_batches=2,
    )
    trainer.fit(module)
    result = {"best": Path(checkpoint.best_model_path).name, "gathered": module.gathered,
              "best_score": float(checkpoint.best_model_score)}
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps(result))
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
