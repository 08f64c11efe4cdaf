"""``LightningCLI`` fit of the test encoder, launched on N processes by tests/helpers/launch.py.

Everything after ``--out OUT`` is LightningCLI's own command line (``--trainer.strategy=...``);
the trainer's other settings match tests/scripts/train.py, so its DDP runs are the reference.
Rank 0 writes the per-step train_loss, the val_loss and the strategy's configuration to OUT.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from tests.helpers.models import EncoderClassifier  # noqa: E402
from tests.scripts.train import Recorder  # noqa: E402


def main() -> None:
    out, argv = sys.argv[2], sys.argv[3:]  # --out OUT, then the CLI's arguments
    torch.set_num_threads(1)
    rec = Recorder()
    steps = 8
    defaults = dict(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=steps, val_check_interval=steps,
        num_sanity_val_steps=0, limit_val_batches=2, callbacks=[rec], enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    cli = LightningCLI(EncoderClassifier, seed_everything_default=7, trainer_defaults=defaults, args=["fit", *argv],
                       save_config_callback=None)
    strategy = cli.trainer.strategy
    config = getattr(strategy, "config", None)
    result = {
        "train_loss": rec.train_loss, "val_loss": rec.val_loss, "strategy": type(strategy).__name__,
        "config": {k: repr(v) for k, v in dataclasses.asdict(config).items()} if config is not None else None,
    }
    if cli.trainer.is_global_zero:
        Path(out).write_text(json.dumps(result))
    sys.stdout.flush()
    torch.distributed.barrier()
    os._exit(0)  # see tests/scripts/train.py: gloo's threads at interpreter exit


if __name__ == "__main__":
    main()
