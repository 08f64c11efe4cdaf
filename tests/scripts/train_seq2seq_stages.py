"""Train tiny Hugging Face encoder-decoders (T5, BART, Marian, mBART, Pegasus), one after the other, in one launch.

Each sits in an ordinary LightningModule: ``AutoModelForSeq2SeqLM.from_config(cfg)`` called with
``input_ids``, ``attention_mask`` (with padding) and ``labels``, the loss computed inside the model.
Rank 0 writes ``{model: {"train": [per-step loss], "val": val loss}}`` to ``--out``. Launched on N
processes by tests/helpers/launch.py (``--strategy ddp`` on one is the reference).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from tests.helpers.script_args import run_each, step_losses_callback  # noqa: E402

VOCAB, SRC, TGT = 96, 10, 6
BART_LIKE = dict(d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
ARCHITECTURES = {  # name: (config class, config arguments)
    "t5": ("T5Config", dict(d_model=32, d_ff=64, num_layers=4, num_decoder_layers=4, num_heads=4, d_kv=8,
                            relative_attention_num_buckets=8)),
    "bart": ("BartConfig", BART_LIKE),
    "marian": ("MarianConfig", BART_LIKE),
    "mbart": ("MBartConfig", BART_LIKE),
    "pegasus": ("PegasusConfig", BART_LIKE),
    "m2m_100": ("M2M100Config", BART_LIKE),
    # mel features in, token ids out: the encoder's convolutions run before its blocks
    "whisper": ("WhisperConfig", {**BART_LIKE, "num_mel_bins": 8, "max_source_positions": SRC, "max_target_positions": 32}),  # layer drop (0.05 by default) is refused under pp: set to 0 here
    # uneven depths: at pp=2 the seam falls inside a stage (the last stage's, the first stage's)
    "t5-6-2": ("T5Config", dict(d_model=32, d_ff=64, num_layers=6, num_decoder_layers=2, num_heads=4, d_kv=8,
                                relative_attention_num_buckets=8)),
    "bart-2-6": ("BartConfig", {**BART_LIKE, "encoder_layers": 2, "decoder_layers": 6}),
}


def build_config(name: str):
    config_cls, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               decoder_start_token_id=0, **extra)
    for key, value in config.to_dict().items():  # dropout off: the comparison is exact
        if isinstance(value, float) and ("dropout" in key or "layerdrop" in key or key.endswith("_rate")) and "init" not in key:
            setattr(config, key, 0.0)
    return config


class Pairs(Dataset):
    """Source ids with right padding (a varying length per row) and target ids, padded with -100."""

    def __init__(self, n: int = 32, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SRC), generator=g)
        lengths = torch.randint(SRC // 2, SRC + 1, (n,), generator=g)
        self.mask = (torch.arange(SRC)[None] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = torch.randint(3, VOCAB, (n, TGT), generator=g)
        self.labels[:, -1] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Features(Pairs):
    """Mel features (``2 * SRC`` frames: Whisper's convolutions halve them) instead of source ids."""

    def __init__(self, n: int = 32, seed: int = 3):
        super().__init__(n, seed)
        self.features = torch.randn(n, 8, 2 * SRC, generator=torch.Generator().manual_seed(seed))

    def __getitem__(self, i):
        return {"input_features": self.features[i], "labels": self.labels[i]}


class Seq2SeqModule(L.LightningModule):
    """What a user writes to fine-tune a sequence-to-sequence model."""

    def __init__(self, name: str):
        super().__init__()
        auto = transformers.AutoModelForSpeechSeq2Seq if name == "whisper" else transformers.AutoModelForSeq2SeqLM
        self.model = auto.from_config(build_config(name))
        self.data = Features if name == "whisper" else Pairs

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-2)

    def train_dataloader(self):
        return DataLoader(self.data(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(self.data(8, seed=5), batch_size=4)


def train(name: str, args) -> dict:
    L.seed_everything(7, verbose=False)
    module = Seq2SeqModule(name)
    if args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=args.tp, pp=args.pp, vp=args.vp, pipeline_schedule=args.schedule,
                                    num_microbatches=args.microbatches,
                                    heartbeat_timeout=60.0)
    losses = step_losses_callback()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        callbacks=[losses], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=2,
                        val_check_interval=args.steps)
    trainer.fit(module, ckpt_path=str(Path(args.resume) / name) if args.resume else None)
    if args.save:  # the strategy's own checkpoint (or DDP's), for a run on another layout to resume
        trainer.save_checkpoint(str(Path(args.save) / name))
    result = {"train": losses.losses, "val": float(trainer.callback_metrics["val_loss"])}
    if args.weights:  # the final weights, whole: the strategy's checkpoint consolidated, or DDP's own
        result["weights"] = _final_weights(trainer, module, Path(args.weights) / name, args.strategy)
    return result


def _final_weights(trainer, module, path: Path, strategy: str) -> str:
    """Where rank 0 saved the whole final ``state_dict`` (a pipelined run's is read back from its checkpoint)."""
    out = path.with_suffix(".pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    if strategy == "ddp":
        torch.save(module.state_dict(), out)
        return str(out)
    from megastrategy.checkpoint import load_full_model_state

    trainer.save_checkpoint(str(path))
    torch.distributed.barrier()
    if int(os.environ["RANK"]) == 0:
        torch.save(load_full_model_state(path), out)
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp", "megatron"], required=True)
    p.add_argument("--models", required=True, help="comma-separated names of ARCHITECTURES")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--vp", type=int, default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--weights", help="a folder: save each model's final weights there, whole")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save", help="a folder: save each model's checkpoint there after the fit")
    p.add_argument("--resume", help="a folder of --save's checkpoints: resume each model's fit from its own")
    args = p.parse_args()
    args.devices = int(os.environ["WORLD_SIZE"])  # read once: a fit may change it
    torch.set_num_threads(1)
    run_each(args.models.split(","), lambda name: train(name, args), args.out)


if __name__ == "__main__":
    main()
