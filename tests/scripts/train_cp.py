"""Several training runs in one launch (context-parallel tests): each case is a fresh Trainer over
the same seed, under DDPStrategy or MegatronStrategy(**kwargs). Starting N processes costs more
than a tiny run, so one launch checks every layout of one world size.

``--cases`` is JSON: ``[{"name", "model", "strategy": "ddp"|"megatron", "kwargs": {...},
"model_kwargs": {...}, "trainer": {...}, "expect_error": bool, "resume": bool, "recompute": form}]``
(refusal cases go last; ``recompute``: how the user recomputes the Hugging Face model's blocks, a key
of ``RECOMPUTE_FORMS``). Rank 0 writes ``{name: {"train_loss", "val_loss", "metrics", "gathered",
"ring_bytes", "attention_calls"} | {"error": message}}``; ``attention_calls`` counts the attention
modules' training calls, replays included.
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
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from tests.context import checkpointed_models as cm  # noqa: E402
from tests.helpers.models import MODELS  # noqa: E402
from tests.scripts.train import Recorder  # noqa: E402


class RingTraffic(L.Callback):
    """Bytes the cp ring sent during fitting (read before the strategy's teardown removes it):
    proof that the sequence really was split."""

    bytes_sent = 0

    def on_train_end(self, trainer, pl_module):
        from megastrategy.all_components import ContextParallelComponent

        part = getattr(trainer.strategy, "component", lambda kind: None)(ContextParallelComponent)
        self.bytes_sent = part.context.ring.bytes_sent if part is not None and part.context is not None else 0


RECOMPUTE_FORMS = {
    "hf": lambda model: cm.hf_gradient_checkpointing(model, reentrant=False),
    "user": lambda model: cm.checkpoint_blocks(model, reentrant=False),
    "user_reentrant": lambda model: cm.checkpoint_blocks(model, reentrant=True),
}


def fit(case: dict, devices: int, max_steps: int, n_train: int, callbacks: list, **fit_kwargs):
    """One Trainer over a fresh module from the same seed; returns (trainer, module)."""
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    module = MODELS[case["model"]](n_layer=2, n_train=n_train, **case.get("model_kwargs", {}))
    if case.get("recompute"):
        RECOMPUTE_FORMS[case["recompute"]](module.model)
    module.attention_calls = cm.count_attention_calls(module, "self_attn")
    if case["strategy"] == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(**case.get("kwargs", {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
        val_check_interval=n_train // 8, num_sanity_val_steps=0, limit_val_batches=2, callbacks=callbacks,
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        **case.get("trainer", {}),
    )
    trainer.fit(module, **fit_kwargs)
    return trainer, module


def run_case(case: dict, steps: int, devices: int, folder: Path) -> dict:
    """The case's losses; with ``"resume": true`` it stops halfway, saves, and resumes in a new Trainer."""
    rec, ring = Recorder(), RingTraffic()
    try:
        if case.get("resume"):
            first, _ = fit(case, devices, steps // 2, 8 * steps, [rec])
            first.save_checkpoint(folder / f"{case['name']}.ckpt")
            fit_kwargs = {"ckpt_path": str(folder / f"{case['name']}.ckpt")}
        else:
            fit_kwargs = {}
        trainer, module = fit(case, devices, steps, 8 * steps, [rec, ring], **fit_kwargs)
    except Exception as error:  # noqa: BLE001 - a refusal case records its message
        if not case.get("expect_error"):
            raise
        return {"error": f"{type(error).__name__}: {error}"}
    return {"train_loss": rec.train_loss, "val_loss": rec.val_loss, "gathered": getattr(module, "gathered", []),
            "ring_bytes": ring.bytes_sent, "attention_calls": module.attention_calls[0], "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    results, devices = {}, int(os.environ["WORLD_SIZE"])  # Lightning's teardown removes the variable
    for case in json.loads(args.cases):
        results[case["name"]] = run_case(case, args.steps, devices, Path(args.out).parent)
        torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no C++ static destructors: gloo's threads can abort a clean exit


if __name__ == "__main__":
    main()
