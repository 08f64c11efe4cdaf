"""Train hand-written transformers (tests/helpers/user_gpts.py: nanoGPT, minGPT, a Llama) a few steps
each in ONE launch, with auto-detection (``tp_plan=None``); rank 0 writes, per model, the per-step
training losses, the applied plan (``name: style`` of every entry that is not plainly replicated)
and the fallback warnings (megastrategy.layers.block_fallback) to ``--out``.

Launched by tests/helpers/launch.py: ``--strategy ddp`` on one process (the reference) or
``--strategy megatron --tp 2``. A model the strategy refuses is recorded with its message.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests.helpers.script_args import layout_parser, run_each  # noqa: E402
from tests.helpers.user_gpts import SEQ, VOCAB, build  # noqa: E402

BATCH, STEPS = 4, 3


class UserLM(L.LightningModule):
    def __init__(self, name: str):
        super().__init__()
        self.model = build(name)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        _, loss = self.model(*batch)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _plan(trainer) -> dict[str, str]:
    from megastrategy.layers.components import TensorParallel

    component = getattr(trainer.strategy, "component", None)
    tp = component and component(TensorParallel)
    if tp is None or tp.plan is None:
        return {}
    return {e.name: e.style + (" (kept whole)" if e.source.endswith("(kept whole)") else "")
            for e in tp.plan.entries if e.style != "replicate" or e.source.endswith("(kept whole)")}


def train_one(name: str, strategy_name: str, tp: int, world_size: int) -> dict:
    from megastrategy.errors import MegatronConfigError

    L.seed_everything(0, verbose=False)
    module = UserLM(name)
    data = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)
    if strategy_name == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=tp)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    handler = Warnings()
    logging.getLogger("megastrategy.layers.block_fallback").addHandler(handler)
    try:
        trainer.fit(module, loader)
    except MegatronConfigError as e:
        return {"error": str(e)}
    finally:
        logging.getLogger("megastrategy.layers.block_fallback").removeHandler(handler)
    return {"loss": module.losses, "plan": _plan(trainer), "warnings": handler.messages}


def main() -> None:
    p = layout_parser()
    p.add_argument("--models", required=True, help="comma-separated names from tests/helpers/user_gpts.MODELS")
    args = p.parse_args()
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])
    run_each(args.models.split(","), lambda name: train_one(name, args.strategy, args.tp, world_size), args.out,
             record_errors=False)


if __name__ == "__main__":
    main()
