"""Soak run: does a long tp=2·pp=2 job stay flat in memory, descriptors, threads and temp files?

2,000 training steps of a tiny Hugging Face BERT classifier on 4 processes, with what long jobs
do: validation every 100 steps, a torchmetrics metric with ``cat`` states (AUROC), ``self.log`` on
every step, and ``ModelCheckpoint`` every 500 steps. Each rank samples its resident memory, open
file descriptors, threads and this job's temporary files after steps 200 and 2,000.

    python bench/soak.py [--steps 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import common

CHECKPOINTS = [200, 2000]


def _status(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def _sample(tmp_root: Path) -> dict:
    return {"rss_mb": _status("VmRSS") / 1024, "fds": len(os.listdir("/proc/self/fd")), "threads": _status("Threads"),
            "py_threads": threading.active_count(),
            "tmp_files": sum(1 for _ in Path(tempfile.gettempdir()).rglob("*")),  # the job's own TMPDIR
            "checkpoints": sum(1 for _ in tmp_root.glob("*.ckpt"))}


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torchmetrics
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import BertConfig, BertForSequenceClassification

    from megastrategy import MegatronStrategy

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=32, num_labels=2)
            self.model = BertForSequenceClassification(cfg)
            self.auroc = torchmetrics.classification.BinaryAUROC()  # ``cat`` states: grows within an epoch

        def training_step(self, batch, batch_idx):
            out = self.model(input_ids=batch[0], labels=batch[1])
            self.log("train_loss", out.loss, prog_bar=True)
            return out.loss

        def validation_step(self, batch, batch_idx):
            out = self.model(input_ids=batch[0], labels=batch[1])
            self.auroc.update(out.logits.softmax(-1)[:, 1], batch[1])
            self.log("val_loss", out.loss, sync_dist=True)

        def on_validation_epoch_end(self):
            self.log("val_auroc", self.auroc.compute())
            self.auroc.reset()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randint(0, 128, (args.steps * 4, 16), generator=g), torch.randint(0, 2, (args.steps * 4,), generator=g))
    val = TensorDataset(torch.randint(0, 128, (32, 16), generator=g), torch.randint(0, 2, (32,), generator=g))
    out = Path(args.out)
    samples: dict[int, dict] = {}

    class Sampler(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in CHECKPOINTS or trainer.global_step == args.steps:
                samples[trainer.global_step] = _sample(out / "ckpt")

    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=MegatronStrategy(tp=2, pp=2), max_steps=args.steps,
        val_check_interval=100, logger=L.pytorch.loggers.CSVLogger(out / "logs"), enable_progress_bar=False,
        callbacks=[Sampler(), L.pytorch.callbacks.ModelCheckpoint(out / "ckpt", every_n_train_steps=500, save_top_k=-1)],
        num_sanity_val_steps=0, enable_model_summary=False,
    )
    trainer.fit(Classifier(), DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(samples))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        os.environ["TMPDIR"] = str(Path(tmp) / "tmpdir")  # the ranks' temporary files, counted alone
        (Path(tmp) / "tmpdir").mkdir()
        common.launch_script(Path(__file__), 4, ["--worker", "--out", tmp, "--steps", str(args.steps)], timeout=3600)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(4)]
    first, last = str(CHECKPOINTS[0]), str(args.steps)
    print(common.machine_line(common.machine_info()))
    rows = []
    for r, s in enumerate(ranks):
        a, b = s[first], s[last]
        rows.append([r, f"{a['rss_mb']:.0f}", f"{b['rss_mb']:.0f}", f"{100 * (b['rss_mb'] / a['rss_mb'] - 1):+.1f}%",
                     f"{a['fds']} -> {b['fds']}", f"{a['threads']} -> {b['threads']}", f"{a['tmp_files']} -> {b['tmp_files']}"])
    print(common.text_table(["rank", f"RSS MB @{first}", f"RSS MB @{last}", "change", "fds", "threads", "temp files"], rows))


if __name__ == "__main__":
    sys.exit(main())
