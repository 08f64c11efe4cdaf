"""One training run of a test model, launched on N processes by tests/helpers/launch.py.

Rank 0 writes what it saw to ``--out``: per-step train_loss and per-validation val_loss.
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

from tests.helpers.models import MODELS  # noqa: E402


class Recorder(Callback):
    def __init__(self):
        self.train_loss, self.val_loss, self.metrics, self.progress = [], [], [], []
        self.early_bucket_starts = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train_loss.append(float(outputs["loss"]))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.progress.append({k: float(v) for k, v in trainer.progress_bar_metrics.items()})
        component = getattr(trainer.strategy, "component", lambda kind: None)
        buffer = getattr(component(_component_type("ddp.component", "GradientBuffers")), "buffer", None)
        self.early_bucket_starts = buffer.num_early_starts if buffer is not None else 0  # buckets reduced during backward

    def on_validation_epoch_end(self, trainer, pl_module):
        if "val_loss" in trainer.callback_metrics and not trainer.sanity_checking:
            self.val_loss.append(float(trainer.callback_metrics["val_loss"]))


class ExampleIds(Callback):
    """Which training examples each step used, over every data-parallel rank: each replica's
    data-loading rank maps its batch's token rows back to dataset indices; rank 0 keeps them."""

    def __init__(self, n_train: int):
        from tests.helpers.models import TokenDataset

        self.index = {tuple(row.tolist()): i for i, row in enumerate(TokenDataset(n_train).ids)}
        self.per_step = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import torch.distributed as dist

        ps = getattr(trainer.strategy, "parallel_state", None)
        loads = ps is None or ps.replica_ranks[0] == trainer.global_rank
        mine = [self.index[tuple(row.tolist())] for row in batch["input_ids"].cpu()] if loads else []
        gathered = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine)
        self.per_step.append(sorted(i for ids in gathered for i in ids))


class FaultInjector(Callback):
    """Makes one rank fail at one step: raise, die by SIGKILL, or produce a NaN gradient."""

    def __init__(self, rank: int, step: int, how: str):
        self.rank, self.step, self.how = rank, step, how

    def _mine(self, trainer) -> bool:
        return trainer.global_rank == self.rank and trainer.global_step == self.step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._mine(trainer) and self.how == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if self._mine(trainer) and self.how == "kill":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # "kill-in-save": die while the --fail-step'th checkpoint (0-based) is being written
        self.saves = getattr(self, "saves", -1) + 1
        if self.how == "kill-in-save" and trainer.global_rank == self.rank and self.saves == self.step:
            import signal
            import threading

            threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()

    def on_after_backward(self, trainer, pl_module):
        if self._mine(trainer) and self.how == "nan":
            p = next(q for q in pl_module.parameters() if q.requires_grad)
            target = p.main_grad if hasattr(p, "main_grad") else p.grad
            target.view(-1)[0] = float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--strategy", choices=["ddp", "megatron"], required=True)
    p.add_argument("--strategy-name", help="with --strategy megatron: Trainer(strategy=NAME), a registered preset")
    p.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...); devices = WORLD_SIZE / num_nodes")
    p.add_argument("--log-level", help="logging.basicConfig(level=...): show megastrategy's log records")
    p.add_argument("--slurm", action="store_true", help="present this launch to Lightning as srun's (SLURM_* variables)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=None)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--n-train", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="per-device batch size")
    p.add_argument("--log-ids", action="store_true", help="record the training examples of every step (all dp ranks)")
    p.add_argument("--save", help="save a checkpoint here after fit")
    p.add_argument("--export-hf", help="after fit: strategy.export_hf(DIR) in small safetensors shards")
    p.add_argument("--resume", help="fit(ckpt_path=...) from here")
    p.add_argument("--eval", action="store_true", help="after fit: validate, test and predict")
    p.add_argument("--fail-rank", type=int, help="fault injection: this global rank fails")
    p.add_argument("--fail-step", type=int, default=2)
    p.add_argument("--fail-how", choices=["raise", "kill", "nan", "kill-in-save"], default="raise")
    p.add_argument("--on-nonfinite", choices=["skip", "raise"], help="MegatronStrategy(detect_anomalies=True, on_nonfinite=...)")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--heartbeat-timeout", type=float, default=60.0)
    p.add_argument("--callbacks", help="a folder: run the sanity check, ModelCheckpoint(monitor) and EarlyStopping")
    p.add_argument("--ckpt-dir", help="a folder: ModelCheckpoint saves '{epoch}-{step}.ckpt' at every epoch end")
    p.add_argument("--ckpt-every", type=int, help="with --ckpt-dir: save every N steps (and last.ckpt) instead of per epoch")
    p.add_argument("--shuffle", action="store_true", help="shuffle the training data (the sampler's order is seeded by epoch)")
    p.add_argument("--no-val", action="store_true", help="no validation during fit (limit_val_batches=0)")
    p.add_argument("--test-ckpt", help="after fit: trainer.test(ckpt_path=...) from here (into the trained, sharded module)")
    p.add_argument("--epochs", type=int, help="stop after this many epochs (max_epochs) instead of after --steps steps")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--user-plan", action="store_true", help="pass the model's TP_PLAN as tp_plan")
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--distributed-optimizer", action="store_true", help="MegatronStrategy(use_distributed_optimizer=True)")
    p.add_argument("--overlap-grad-reduce", nargs="?", const="on", choices=["on", "off"],
                   help="MegatronStrategy(overlap_grad_reduce=True/False); absent: the default (None = auto)")
    p.add_argument("--overlap-param-gather", action="store_true", help="MegatronStrategy(overlap_param_gather=True)")
    p.add_argument("--pipeline-schedule", help="MegatronStrategy(pipeline_schedule=...)")
    p.add_argument("--num-microbatches", type=int, help="MegatronStrategy(num_microbatches=...) (default: pp)")
    p.add_argument("--stage-layers", help="MegatronStrategy(pipeline_stage_layers=...), comma-separated counts")
    p.add_argument("--async-checkpoint", action="store_true", help="MegatronStrategy(async_checkpoint=True)")
    p.add_argument("--bucket-numel", type=int, help="MegatronStrategy(bucket_numel=...)")
    p.add_argument("--sequence-parallel", action="store_true", help="MegatronStrategy(sequence_parallel=True)")
    p.add_argument("--recompute", choices=["full", "selective"], help="MegatronStrategy(activation_checkpointing=...)")
    p.add_argument("--stub-cuda-graphs", help="cuda_graph_scope (comma-separated) on CPU with a stub graphing function")
    p.add_argument("--freeze", help="requires_grad_(False) on this submodule (e.g. wte), as fine-tuning code does")
    p.add_argument("--dropout", type=float, help="set p of every nn.Dropout (and nn.MultiheadAttention) of the model")
    args = p.parse_args()
    if args.slurm:
        _as_srun_task(args.num_nodes)
    if args.log_level:
        import logging

        logging.basicConfig(level=args.log_level, format="%(name)s: %(message)s")

    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    sizes = {"batch_size": args.batch_size} if args.batch_size != 4 else {}
    module = MODELS[args.model](n_layer=args.layers, optimizer=args.optimizer, n_train=args.n_train, **sizes)
    if args.shuffle:
        module.shuffle_train = True
    if args.freeze:
        module.get_submodule(args.freeze).requires_grad_(False)
    if args.dropout is not None:
        for m in module.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = args.dropout
            elif isinstance(m, torch.nn.MultiheadAttention):
                m.dropout = args.dropout
    if args.strategy == "ddp":
        strategy = DDPStrategy()
    elif args.strategy_name:
        import megastrategy  # noqa: F401 - registers the preset names

        strategy = args.strategy_name
    else:
        from megastrategy import MegatronStrategy

        plan = getattr(module, "TP_PLAN", None) if args.user_plan else None
        extra = {"detect_anomalies": True, "on_nonfinite": args.on_nonfinite} if args.on_nonfinite else {}
        if args.bucket_numel:
            extra["bucket_numel"] = args.bucket_numel
        if args.async_checkpoint:
            extra["async_checkpoint"] = True
        if args.pipeline_schedule:
            extra["pipeline_schedule"] = args.pipeline_schedule
        if args.num_microbatches:
            extra["num_microbatches"] = args.num_microbatches
        if args.stage_layers:
            extra["pipeline_stage_layers"] = tuple(int(n) for n in args.stage_layers.split(","))
        if args.distributed_optimizer:
            extra.update(use_distributed_optimizer=True, overlap_param_gather=args.overlap_param_gather)
        if args.overlap_grad_reduce:
            extra["overlap_grad_reduce"] = args.overlap_grad_reduce == "on"
        if args.sequence_parallel or args.recompute:
            extra.update(sequence_parallel=args.sequence_parallel, activation_checkpointing=args.recompute)
        make = MegatronStrategy
        if args.stub_cuda_graphs:
            from tests.helpers.stub_cuda_graphs import strategy_with_stub_graphs as make

            extra["cuda_graph_scope"] = args.stub_cuda_graphs.split(",")
        strategy = make(
            tp=args.tp, pp=args.pp, vp=args.vp, ep=args.ep, etp=args.etp, tp_plan=plan,
            heartbeat_timeout=args.heartbeat_timeout, **extra
        )
    rec = Recorder()
    callbacks = [rec]
    ids = ExampleIds(args.n_train) if args.log_ids else None
    callbacks += [ids] if ids is not None else []
    if args.fail_rank is not None:
        callbacks.append(FaultInjector(args.fail_rank, args.fail_step, args.fail_how))
    if args.callbacks:
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

        callbacks += [
            ModelCheckpoint(dirpath=args.callbacks, monitor="val_loss", save_top_k=1, every_n_train_steps=args.steps),
            EarlyStopping(monitor="val_loss", patience=100),
        ]
    if args.ckpt_dir:
        from lightning.pytorch.callbacks import ModelCheckpoint

        when = (
            {"every_n_train_steps": args.ckpt_every, "save_last": True}
            if args.ckpt_every
            else {"every_n_epochs": 1, "save_on_train_epoch_end": True}
        )
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{epoch}-{step}", save_top_k=-1, **when))
    world_size = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size // args.num_nodes,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=-1 if args.epochs else args.steps,
        max_epochs=args.epochs,
        val_check_interval=args.steps,
        num_sanity_val_steps=2 if args.callbacks else 0,
        limit_val_batches=0 if args.no_val else 2,
        callbacks=callbacks,
        enable_checkpointing=bool(args.callbacks or args.ckpt_dir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=args.clip,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
    )
    trainer.fit(module, ckpt_path=args.resume)
    strategy = trainer.strategy
    result = {"train_loss": rec.train_loss, "val_loss": rec.val_loss, "metrics": rec.metrics, "progress": rec.progress}
    result["example_ids"] = ids.per_step if ids is not None else None
    result["final_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if args.callbacks:
        result["best_model_score"] = float(trainer.checkpoint_callback.best_model_score)
    if args.save:
        trainer.save_checkpoint(args.save)
    if args.export_hf:
        strategy.export_hf(args.export_hf, max_shard_bytes=16_000)  # small shards: several files for a tiny model
    if args.test_ckpt:
        result["test_ckpt"] = trainer.test(module, ckpt_path=args.test_ckpt, verbose=False)[0]["test_loss"]
    if args.eval:
        result["validate"] = trainer.validate(module, verbose=False)[0]["val_loss"]
        result["test"] = trainer.test(module, verbose=False)[0]["test_loss"]
        preds = trainer.predict(module)
        result["predict"] = [float(x) for p in preds for x in p.reshape(-1)]
    component = getattr(strategy, "component", lambda kind: None)
    guard = component(_component_type("ddp.nonfinite_guard", "NonFiniteGuard"))
    result["skipped_steps"] = guard.skipped_steps if guard is not None else 0
    result["optimizer"] = type(trainer.optimizers[0]).__name__
    result["early_bucket_starts"] = rec.early_bucket_starts
    gathers = [o.param_gather for o in trainer.optimizers if getattr(o, "param_gather", None) is not None]
    result["gathers_waited_in_forward"] = sum(g.num_waited_in_forward for g in gathers)
    graphs = getattr(component(_component_type("cuda_graphs.component", "CudaGraphs")), "manager", None)
    if graphs is not None:
        result["cuda_graph_counts"] = dict(graphs.counts())
    result["param_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
    result["environment"] = type(strategy.cluster_environment).__name__
    result["layout"] = _layout(strategy)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps(result))
    # Leave without running C++ static destructors: gloo's threads can abort the process at
    # interpreter exit ("terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    os._exit(0)


def _as_srun_task(num_nodes: int) -> None:
    """The variables ``srun --nodes N --ntasks-per-node K`` sets for one task, from this launch's rank;
    torchrun's RANK/LOCAL_RANK/WORLD_SIZE go, so that only SLURM's describe the job."""
    rank, world = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    os.environ.pop("LOCAL_RANK")
    per_node = world // num_nodes
    os.environ.update(
        SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NNODES=str(num_nodes),
        SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node),
        SLURM_NODELIST="127.0.0.1", SLURM_JOB_NAME="megastrategy-test", SLURM_JOB_ID="4242",
    )


def _layout(strategy) -> dict:
    """Sizes and this rank's (rank 0's) group members, as the strategy set them up."""
    ps = getattr(strategy, "parallel_state", None)
    if ps is None:
        return {"world_size": strategy.world_size}
    import torch.distributed as dist

    groups = {name: dist.get_process_group_ranks(getattr(ps, f"{name}_group")) for name in ("tp", "dp")}
    return {"world_size": strategy.world_size, "tp": ps.tp_size, "dp": ps.dp_size, "groups": groups}


def _component_type(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"megastrategy.{module}"), name)


if __name__ == "__main__":
    main()
