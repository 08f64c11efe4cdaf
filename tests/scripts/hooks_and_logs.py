"""What a user records in Lightning's gradient hooks and logs with each ``reduce_fx``.

A Hugging Face BERT classifier that, as user code does, records ``p.grad`` norms in
``on_after_backward`` and ``on_before_optimizer_step``, ``grad_norm(self)``, the loss given to
``on_before_backward``, how often each hook runs, and logs values with every reduction. Launched
on N processes by tests/helpers/launch.py; every rank's records are gathered, rank 0 writes them
with the metrics Lightning showed to ``--out``.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402

from tests.helpers.models import BertClassifier  # noqa: E402
from tests.helpers.script_args import layout_parser  # noqa: E402


def _is_shard(p: torch.nn.Parameter) -> bool:
    try:
        from megastrategy.layers.shard_spec import get_shard_spec
    except ImportError:  # pragma: no cover
        return False
    return get_shard_spec(p) is not None


class HookedBert(BertClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.rec = {"before_backward": [], "after_backward": [], "before_opt": [], "lightning_total": [],
                    "true_norm": [], "missing": [], "counts": Counter()}

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        labels, mask = batch["labels"].float(), batch["attention_mask"].float()
        tokens = mask.sum()
        self.log("train_loss", out.loss)
        self.log("l_sum", labels.sum(), reduce_fx="sum", on_step=True, on_epoch=True)
        self.log("l_max", labels.max(), reduce_fx="max", on_step=True, on_epoch=True)
        self.log("l_min", labels.min(), reduce_fx=torch.min, on_step=True, on_epoch=True)
        self.log("l_mean", labels.mean(), on_step=True, on_epoch=True)
        per_token = (batch["input_ids"].float() * mask).sum() / tokens
        self.log("per_token", per_token, batch_size=int(tokens), on_step=True, on_epoch=True)
        self.log("loss_sync", out.loss, sync_dist=True, on_step=False, on_epoch=True)
        return out.loss

    def _grads(self, key: str) -> None:
        self.rec[key].append({n: [float(p.grad.double().pow(2).sum()), _is_shard(p)]
                              for n, p in self.named_parameters() if p.grad is not None})
        self.rec["missing"].append([n for n, p in self.named_parameters() if p.requires_grad and p.grad is None])

    def on_before_backward(self, loss):
        self.rec["counts"]["on_before_backward"] += 1
        self.rec["before_backward"].append(float(loss))

    def on_after_backward(self):
        self.rec["counts"]["on_after_backward"] += 1
        self._grads("after_backward")

    def on_before_optimizer_step(self, optimizer):
        self.rec["counts"]["on_before_optimizer_step"] += 1
        self._grads("before_opt")
        self.rec["lightning_total"].append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))
        true = getattr(self.trainer.strategy, "grad_norm", None)
        self.rec["true_norm"].append(float(true()) if true is not None else self.rec["lightning_total"][-1])


class MetricsEachStep(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def main() -> None:
    p = layout_parser()
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--overlap", action="store_true", help="MegatronStrategy(overlap_grad_reduce=True)")
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    module = HookedBert(n_layer=4, n_train=16)
    if args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=args.tp, pp=args.pp, overlap_grad_reduce=args.overlap)
    metrics = MetricsEachStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=1,
        limit_val_batches=0, callbacks=[metrics], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        accumulate_grad_batches=args.accumulate,
    )
    trainer.fit(module)
    state = getattr(strategy, "parallel_state", None)
    module.rec["replica"] = state.dp_rank if state is not None else trainer.global_rank
    ranks = [None] * trainer.world_size
    if dist.is_initialized():
        dist.all_gather_object(ranks, module.rec)
    else:
        ranks = [module.rec]
    if trainer.is_global_zero:
        final = {k: float(v) for k, v in trainer.callback_metrics.items()}
        Path(args.out).write_text(json.dumps({"ranks": ranks, "steps": metrics.steps, "final": final}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
