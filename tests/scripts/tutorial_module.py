"""Lightning's text-classification tutorial module (``GLUETransformer``) with what users add to it.

A Hugging Face ``BertForSequenceClassification`` built ``from_config`` (tiny, binary labels), as the
tutorial writes it: ``validation_step`` appends ``{"loss", "preds", "labels"}`` to
``self.outputs[dataloader_idx]`` and ``on_validation_epoch_end`` concatenates them into ``val_loss``
and an accuracy. Besides: a torchmetrics ``BinaryAccuracy`` updated in the step and computed at epoch
end, ``self.all_gather`` of the predictions at epoch end, steps returning a dict with extra keys
(training, validation), a tuple (test) and the model's ``ModelOutput`` (predict), recorded by
``on_*_batch_end(outputs)`` and by ``trainer.predict``. Launched on N processes by
tests/helpers/launch.py; rank 0 writes what every rank recorded and what Lightning logged to ``--out``.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchmetrics.classification import BinaryAccuracy  # noqa: E402

from tests.helpers.models import SEQ, VOCAB, TokenDataset  # noqa: E402
from tests.helpers.script_args import layout_parser  # noqa: E402


def _plain(value):
    """JSON-able view of a step output: tensors as lists, containers by their type name and items."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().tolist()
    if isinstance(value, dict):
        return {"type": type(value).__name__, **{k: _plain(v) for k, v in value.items()}}
    if isinstance(value, (tuple, list)):
        return {"type": type(value).__name__, "items": [_plain(v) for v in value]}
    return value


class GLUETransformer(L.LightningModule):
    def __init__(self, n_layer: int = 4, batch_size: int = 4):
        super().__init__()
        from transformers import AutoModelForSequenceClassification, BertConfig

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n_layer, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.model = AutoModelForSequenceClassification.from_config(config)
        self.batch_size = batch_size
        self.accuracy = BinaryAccuracy()
        self.outputs = defaultdict(list)
        self.rec = defaultdict(list)

    def forward(self, **inputs):
        return self.model(**inputs)

    def training_step(self, batch, batch_idx):
        outputs = self(**batch)
        loss = outputs[0]
        correct = (outputs.logits.argmax(-1) == batch["labels"]).sum()
        self.log("train_loss", loss)
        return {"loss": loss, "correct": correct, "logits": outputs.logits}

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.rec["seen_before_forward"].append(batch["labels"].numel())  # a side effect before the model call
        outputs = self(**batch)
        val_loss, logits = outputs[:2]
        preds = torch.argmax(logits, axis=1)
        labels = batch["labels"]
        self.outputs[dataloader_idx].append({"loss": val_loss, "preds": preds, "labels": labels})
        self.accuracy.update(preds, labels)
        return {"loss": val_loss, "preds": preds}

    def on_validation_epoch_end(self):
        preds = torch.cat([x["preds"] for x in self.outputs[0]])
        labels = torch.cat([x["labels"] for x in self.outputs[0]])
        loss = torch.stack([x["loss"] for x in self.outputs[0]]).mean()
        self.log("val_loss", loss, prog_bar=True)
        self.log("accuracy", (preds == labels).float().mean(), prog_bar=True)
        self.log("tm_accuracy", self.accuracy.compute())
        self.accuracy.reset()
        gathered = self.all_gather(torch.stack([preds, labels], dim=1))
        self.rec["gathered"].append(sorted(gathered.reshape(-1, 2).tolist()))
        self.outputs.clear()

    def test_step(self, batch, batch_idx):
        outputs = self(**batch)
        return outputs.logits.argmax(-1), outputs.loss

    def predict_step(self, batch, batch_idx):
        return self(**batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TokenDataset(16, num_labels=2), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TokenDataset(16, num_labels=2, seed=99), batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(TokenDataset(8, num_labels=2, seed=5), batch_size=self.batch_size)

    predict_dataloader = test_dataloader


class Recorder(L.Callback):
    """What Lightning hands to callbacks: the metrics after each step and each batch's outputs."""

    def __init__(self, rec):
        self.rec = rec

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rec["train_outputs"].append(_plain(outputs))
        self.rec["train_metrics"].append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.rec["val_outputs"].append(_plain(outputs))

    def on_train_epoch_end(self, trainer, pl_module):  # after the epoch's validation
        self.rec["epoch_metrics"].append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.rec["metric_devices"].append({k: str(v.device) for k, v in trainer.callback_metrics.items()})

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.rec["test_outputs"].append(_plain(outputs))


def placement(device: str, world: int) -> tuple[dict, dict]:
    """Trainer and strategy arguments that put every rank on ``device``.

    ``cuda`` puts all ranks on GPU 0 with gloo (NCCL refuses two ranks on one GPU), so one GPU
    runs the CUDA-tensor paths of a multi-rank job: tensors, logged values and metrics on the GPU.
    """
    if device == "cpu":
        return {"accelerator": "cpu", "devices": world}, {}
    gpus = [torch.device("cuda", 0)] * world
    return {"accelerator": "cuda", "devices": 1}, {"parallel_devices": gpus, "process_group_backend": "gloo"}


def main() -> None:
    parser = layout_parser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(3, verbose=False)
    module = GLUETransformer()
    where, spread = placement(args.device, int(os.environ["WORLD_SIZE"]))
    if args.strategy == "ddp":
        strategy = DDPStrategy(**spread)
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=args.tp, pp=args.pp, vp=args.vp, **spread)
    trainer = L.Trainer(
        **where, strategy=strategy, max_epochs=2,
        callbacks=[Recorder(module.rec)], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )
    trainer.fit(module)
    trainer.test(module, verbose=False)
    module.rec["predictions"] = [_plain(out) for out in trainer.predict(module)]
    state = getattr(strategy, "parallel_state", None)
    module.rec["replica"] = state.dp_rank if state is not None else trainer.global_rank
    ranks = [None] * trainer.world_size
    if dist.is_initialized():
        dist.all_gather_object(ranks, dict(module.rec))
    else:
        ranks = [dict(module.rec)]
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"ranks": ranks}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
