"""What the Hugging Face BERT benches share: the model, its batches, a step timer, the ranks' results.

``bench_pp_peers.py``, ``bench_tp_peers.py`` and ``bench_dp.py`` train the same kind of
``BertForSequenceClassification`` in Lightning against a peer and time each step the same way;
keeping those pieces here keeps the sides of every comparison identical.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def bert_classifier(hidden: int, layers: int, vocab: int, max_positions: int = 512):
    """A ``BertForSequenceClassification`` built ``from_config`` (seed 0, dropout off, 2 labels)."""
    from transformers import AutoModelForSequenceClassification, BertConfig

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * hidden, max_position_embeddings=max_positions, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


def token_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1) -> torch.utils.data.DataLoader:
    """``steps`` batches of random token ids and binary labels, the same in every process for a seed."""
    g = torch.Generator().manual_seed(seed)
    n = steps * batch
    ids, labels = torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, 2, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=batch)


def step_timer() -> Any:
    """A Lightning callback recording each training step's wall and CPU time and loss, and each
    validation step's wall time (``step``, ``cpu``, ``loss``, ``val`` lists, seconds)."""
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self):
            self.step, self.cpu, self.loss, self.val = [], [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step.append(time.perf_counter() - self._t0)
            self.cpu.append(time.process_time() - self._c0)
            self.loss.append(float(outputs["loss"]))

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self._v0 = time.perf_counter()

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.val.append(time.perf_counter() - self._v0)

    return StepTimer()


def timer_record(timer: Any) -> dict:
    return {"step": timer.step, "cpu": timer.cpu, "loss": timer.loss, "val": timer.val}


def read_ranks(out: str | Path, nprocs: int) -> list[dict]:
    """The records each rank wrote to ``{out}.rank{r}.json``."""
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nprocs)]


def slowest_median_ms(ranks: list[dict], key: str, warmup: int) -> float:
    """The slowest rank's median of ``key`` after ``warmup`` entries, in ms."""
    return max(statistics.median(r[key][warmup:]) for r in ranks) * 1e3


def cpu_ms_per_rank(ranks: list[dict], warmup: int) -> list[float]:
    return [statistics.median(r["cpu"][warmup:]) * 1e3 for r in ranks]
