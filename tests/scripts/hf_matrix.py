"""Train many tiny Hugging Face models a few steps each in ONE launch; rank 0 writes, per model,
the per-step training losses, the validation loss and the plan's sources to ``--out``.

Each model sits in an ordinary LightningModule whose ``forward`` passes ``labels=`` so the loss
is computed inside the Hugging Face model. Launched by tests/helpers/launch.py:
``--strategy ddp`` on one process (the one-device reference) or ``--strategy megatron --tp 2``
(or ``--pp 2``, ``--cp 2``, ``--activation-checkpointing full``, ``--sequence-parallel``; or ``--ep 2`` for MoE models, against DDP on the same two processes). Inputs follow the task (tokens, pixels, a waveform, mel features).
A model the strategy refuses (a clear ``MegatronConfigError`` on every rank in setup) is
recorded with its message and the launch goes on with the next model.
"""
from __future__ import annotations

import argparse
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
from torch.utils.data import DataLoader  # noqa: E402

from tests.helpers.hf_zoo import TASK_AUTO, VOCAB, tiny_model  # noqa: E402
from tests.helpers.script_args import leave_without_static_destructors  # noqa: E402

SEQ, BATCH, STEPS = 12, 4, 3


class TokenBatches(torch.utils.data.Dataset):
    """Random inputs and labels per task: causal-LM and seq2seq labels = the tokens, masked-LM labels =
    15% of them, classifiers (sequence, token, image, audio): 3 classes, QA: start/end positions,
    multiple choice: 2 choices, ASR (Whisper): 8 mel bins x 32 frames with token labels."""

    def __init__(self, n: int, task: str, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        self.masked = torch.rand(n, SEQ, generator=g) < 0.15
        self.masked[:, 0] = True
        self.cls = torch.randint(0, 3, (n,), generator=g)
        self.extra = _task_tensors(task, n, g)
        self.task = task

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        if self.task in _TASK_INPUTS:
            return {k: v[i] for k, v in self.extra.items()}
        if self.task == "cls":
            return {"input_ids": ids, "labels": self.cls[i]}
        if self.task == "mlm":
            return {"input_ids": ids.masked_fill(self.masked[i], 4), "labels": ids.masked_fill(~self.masked[i], -100)}
        return {"input_ids": ids, "labels": ids}


#: tasks whose examples are all drawn by ``_task_tensors``: name -> {key: (shape after n, high or None)}
_TASK_INPUTS = {
    "tok": {"input_ids": ((SEQ,), VOCAB), "labels": ((SEQ,), 3)},
    "qa": {"input_ids": ((SEQ,), VOCAB), "start_positions": ((), SEQ), "end_positions": ((), SEQ)},
    "mc": {"input_ids": ((2, SEQ), VOCAB), "labels": ((), 2)},
    "img": {"pixel_values": ((3, 16, 16), None), "labels": ((), 3)},
    "audio": {"input_values": ((160,), None), "labels": ((), 3)},
    "ctc": {"input_values": ((160,), None), "labels": ((5,), VOCAB)},  # 5 tokens for 15 frames
    "asr": {"input_features": ((8, 32), None), "labels": ((SEQ,), VOCAB)},
    # a dual encoder (CLIPModel with return_loss=True): text and images of matching pairs, contrastive loss
    "dual": {"input_ids": ((SEQ,), 100), "pixel_values": ((3, 16, 16), None)},
    # SigLIP2's images as patches (a 4 x 4 grid of 3 x 4 x 4 patches, all real; see _task_tensors)
    "patches": {"pixel_values": ((16, 48), None), "labels": ((), 3)},
}


def _task_tensors(task: str, n: int, g: torch.Generator) -> dict:
    """Integers in [3, high) for token ids ([0, high) for labels), standard normal floats otherwise."""
    out = {}
    for key, (shape, high) in _TASK_INPUTS.get(task, {}).items():
        low = 3 if key == "input_ids" or task == "ctc" else 0  # CTC: no blank (pad id 0) among the labels
        out[key] = torch.randn((n, *shape), generator=g) if high is None else torch.randint(low, high, (n, *shape), generator=g)
    if task == "patches":  # the patches' grid and mask: constants, not drawn
        out["spatial_shapes"] = torch.tensor([[4, 4]]).repeat(n, 1)
        out["pixel_attention_mask"] = torch.ones((n, 16), dtype=torch.long)
    return out


class HFModule(L.LightningModule):
    """What a user writes: the HF model built from a config, the loss from ``labels=``."""

    def __init__(self, arch: str, task: str):
        super().__init__()
        self.task = task
        self.model = tiny_model(arch, task=task if task in ("cls", *TASK_AUTO) else "lm")

    def forward(self, batch):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        loss = self(batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        return DataLoader(TokenBatches(STEPS * BATCH, self.task, 1), batch_size=BATCH)

    def val_dataloader(self):
        return DataLoader(TokenBatches(2 * BATCH, self.task, 2), batch_size=BATCH)


class Recorder(Callback):
    def __init__(self):
        self.losses, self.val_loss, self.sources, self.numel = [], None, [], 0
        self.batches_started = 0  # 0 in a refusal's result: it came in setup, before any work was lost

    def on_train_start(self, trainer, pl_module):
        self.numel = sum(p.numel() for p in pl_module.parameters())  # what rank 0 holds: shows a split
        component = getattr(trainer.strategy, "component", None)
        tensor_parallel = component and component(_tensor_parallel_type())
        if tensor_parallel is not None:
            self.sources = sorted({e.source for e in tensor_parallel.plan.sharded})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches_started += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val_loss = float(trainer.callback_metrics["val_loss"])


def _tensor_parallel_type():
    from megastrategy.layers.components import TensorParallel

    return TensorParallel


def train_one(arch: str, task: str, strategy_name: str, tp: int, pp: int, world_size: int,
              keep_going: bool = False, ep: int = 1, find_unused: bool = False, cp: int = 1,
              activation_checkpointing=None, sequence_parallel=False) -> dict:
    from megastrategy.errors import MegatronConfigError

    L.seed_everything(0, verbose=False)
    module = HFModule(arch, task)
    if strategy_name == "ddp":
        strategy = DDPStrategy(find_unused_parameters=find_unused)
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=tp, pp=pp, cp=cp, activation_checkpointing=activation_checkpointing,
                                    sequence_parallel=sequence_parallel, **({"ep": ep, "etp": 1} if ep > 1 else {}))
    rec = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1,
        limit_val_batches=2, num_sanity_val_steps=0, callbacks=[rec], enable_checkpointing=False,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(module)
    except MegatronConfigError as e:
        return {"error": str(e), "batches_started": rec.batches_started}
    except Exception as e:  # noqa: BLE001 - only with --keep-going (probing): a crash is recorded, not raised
        if not keep_going:
            raise
        return {"crash": f"{type(e).__name__}: {e}"[:2000]}
    return {"loss": rec.losses, "val_loss": rec.val_loss, "sources": rec.sources, "numel": rec.numel}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp", "megatron"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help=f"context parallel; SEQ={SEQ} must divide by 2*cp (balanced layout)")
    p.add_argument("--activation-checkpointing", choices=["full", "selective"], default=None)
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp > 1")
    p.add_argument("--keep-going", action="store_true", help="record any exception and go on (probing)")
    p.add_argument("--find-unused", action="store_true",
                   help="DDP reference: allow parameters the loss does not use (a decoder's cross-attention, a vision tower)")
    p.add_argument("--models", required=True, help="comma-separated arch:task, task in lm/mlm/cls/s2s/tok/qa/mc/img/audio/ctc/asr")
    args = p.parse_args()
    torch.set_num_threads(1)
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
           if k in os.environ}
    results = {}
    for item in args.models.split(","):
        arch, task = item.split(":")
        os.environ.update(env)  # Lightning's teardown removes the launcher's variables
        results[item] = train_one(arch, task, args.strategy, args.tp, args.pp, world_size, args.keep_going, args.ep,
                                 args.find_unused, args.cp, args.activation_checkpointing, args.sequence_parallel)
        if rank == 0 and args.keep_going:  # what is done so far, should a later model stop the launch
            Path(args.out).write_text(json.dumps(results, indent=1))
    if rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    leave_without_static_destructors()
