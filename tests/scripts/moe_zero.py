"""The distributed optimizer (ZeRO-1) and bf16-true with MoE layers, one launch for many cases.

Each case of ``CASES`` fits an unchanged module (the repo's MoE GPT, or a Hugging Face Mixtral /
Qwen3-MoE from ``AutoModelForCausalLM.from_config`` trained with ``labels=``) under
``DDPStrategy`` or ``MegatronStrategy(ep=..., use_distributed_optimizer=...)``; rank 0 records the
per-step losses and, under ours, which optimizer stepped and how much of the experts' optimizer
state this rank holds (ZeRO-1 shards it over the expert-data-parallel ranks). ``*-resume`` cases
save at the end of epoch 0 and resume in a new Trainer on the same layout, without ZeRO-1, and at ep1.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from tests.helpers.script_args import launcher_env, layout_parser, run_each, step_losses_callback  # noqa: E402

_ENV = launcher_env()  # Lightning's teardown removes the launcher's variables: restored before each fit

# name: model, ep, ZeRO-1, optimizer, precision, gradient_clip_val, accumulate_grad_batches, both overlaps
# (tp comes from the command line; etp=1)
CASES = {
    "gpt-adamw-sched": dict(model="moe-gpt", ep=2, zero=True, optimizer="adamw-sched"),
    "gpt-sgd-clip": dict(model="moe-gpt", ep=2, zero=True, optimizer="sgd", clip=0.05),
    "gpt-dp-accumulate": dict(model="moe-gpt", ep=1, zero=True, optimizer="sgd", clip=0.05, accumulate=2),
    "gpt-sgd": dict(model="moe-gpt", ep=2, zero=True, optimizer="sgd"),  # DDP only: the clip bites
    "gpt-dp-experts-replicated": dict(model="moe-gpt", ep=1, zero=True, optimizer="sgd", clip=0.05),
    # both buffers reduce-scattered during backward and gathered in the next forward, several buckets each
    "gpt-overlap": dict(model="moe-gpt", ep=1, zero=True, optimizer="adamw-sched", overlap=True),
    "mixtral-clip": dict(model="mixtral", ep=2, zero=True, optimizer="sgd", clip=0.05),
    "mixtral": dict(model="mixtral", ep=2, zero=True, optimizer="sgd"),  # DDP only: the clip bites
    "qwen3-sched": dict(model="qwen3_moe", ep=2, zero=True, optimizer="adamw-sched"),
    "gpt-resume": dict(model="moe-gpt", ep=2, zero=True, optimizer="adamw-sched", epochs=2),
    "gpt-bf16": dict(model="moe-gpt", ep=2, zero=False, optimizer="adamw", precision="bf16-true"),
    "gpt-bf16-zero": dict(model="moe-gpt", ep=2, zero=True, optimizer="adamw", precision="bf16-true"),
    # the experts' fp32 main weights travel in the checkpoint's optimizer state: the resume is exact
    "gpt-bf16-resume": dict(model="moe-gpt", ep=2, zero=True, optimizer="adamw", precision="bf16-true", epochs=2,
                            resumes=["resumed"]),
    "gpt-fp32": dict(model="moe-gpt", ep=2, zero=False, optimizer="adamw"),
}


RESUMES = {"resumed": {}, "resumed_plain": {"zero": False}, "resumed_ep1": {"ep": 1},
           "resumed_ep1_plain": {"ep": 1, "zero": False}}


def _configure(module: L.LightningModule, optimizer: str):
    """AdamW with experts in their own parameter group (another learning rate) and a per-step
    LambdaLR ("adamw-sched"); plain AdamW; or SGD(lr=0.5), which shows a mis-scaled gradient."""
    if optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=0.5)
    if optimizer == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    named = list(module.named_parameters())
    experts = [p for n, p in named if "expert" in n]
    others = [p for n, p in named if "expert" not in n]
    opt = torch.optim.AdamW([{"params": others}, {"params": experts, "lr": 3e-3}], lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def build(case: dict) -> L.LightningModule:
    optimizer = case["optimizer"]
    if case["model"] == "moe-gpt":
        from tests.helpers.moe_models import MoEGPT

        class GPT(MoEGPT):
            def configure_optimizers(self):
                return _configure(self, optimizer)

        return GPT(n_train=32)
    from tests.scripts.hf_moe import CausalLM

    class HF(CausalLM):
        def configure_optimizers(self):
            return _configure(self, optimizer)

        def train_dataloader(self):
            data = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(7))
            return torch.utils.data.DataLoader(list(data), batch_size=4)

    return HF(case["model"])


def strategy_for(case: dict, args, module):
    if args.strategy == "ddp":
        return DDPStrategy()
    from megastrategy import MegatronStrategy

    plan = getattr(module, "TP_PLAN", None) if args.tp > 1 else None
    overlap = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_numel=3000) if case.get("overlap") else {}
    return MegatronStrategy(tp=args.tp, pp=args.pp, ep=case["ep"], etp=1, tp_plan=plan, use_distributed_optimizer=case["zero"],
                            **overlap)


def expert_state_fraction(trainer) -> float:
    """The share of the expert parameters' elements this rank's optimizer steps and holds the
    state of (its pieces): ``1/edp`` under ZeRO-1, 1 otherwise."""
    from megastrategy.moe.integration import is_expert_parameter

    pieces = [piece for piece in getattr(trainer.optimizers[0], "_pieces", []) if is_expert_parameter(piece.param)]
    total = sum(p.numel() for p in trainer.lightning_module.parameters() if is_expert_parameter(p))
    return sum(piece.numel for piece in pieces) / total if total else 0.0


def expert_main_checksum(trainer) -> float:
    """The experts' fp32 main weights at the end, summed with a weight per element (float64): equal
    after an uninterrupted and a resumed run only if the resume restored them."""
    from megastrategy.moe.integration import is_expert_parameter

    total = 0.0
    for piece in getattr(trainer.optimizers[0], "_pieces", []):
        if is_expert_parameter(piece.param):
            main = piece.main.detach().double().reshape(-1)
            total += float((main * torch.arange(1, main.numel() + 1, dtype=torch.float64)).sum())
    return total


def expert_main_offset(trainer) -> float:
    """The largest difference between an expert parameter and its fp32 main weight: above zero
    only where the main weights keep what the bf16 parameters cannot (0 for fp32 parameters)."""
    from megastrategy.moe.integration import is_expert_parameter

    offsets = [(piece.main.reshape(-1) - piece.param.detach().float().reshape(-1)[piece.lo : piece.hi]).abs().max()
               for piece in getattr(trainer.optimizers[0], "_pieces", []) if is_expert_parameter(piece.param)]
    return float(max(offsets)) if offsets else 0.0


class GradNorms(L.Callback):
    """The whole model's gradient norm before each step (2 and inf): ``trainer.strategy.grad_norm``
    under ours, torch's norm of every ``p.grad`` under DDP (before clipping in both)."""

    def __init__(self) -> None:
        self.norms: list[list[float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if hasattr(trainer.strategy, "grad_norm"):
            norms = [trainer.strategy.grad_norm(p) for p in (2.0, float("inf"))]
        else:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms = [torch.nn.utils.get_total_norm(grads, p) for p in (2.0, float("inf"))]
        self.norms.append([float(n) for n in norms])


def fit(case: dict, args, epochs: int, ckpt_dir=None, ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ.update(_ENV)
    L.seed_everything(0, verbose=False)
    module, losses, norms = build(case), step_losses_callback(), GradNorms()
    callbacks = [losses, norms]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                                         save_on_train_epoch_end=True))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy_for(case, args, module),
        max_epochs=epochs, limit_val_batches=0, logger=False, enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, precision=case.get("precision", "32-true"),
        gradient_clip_val=case.get("clip"), accumulate_grad_batches=case.get("accumulate", 1),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    trainer.grad_norms = norms.norms
    return losses.losses, trainer


def train_one(name: str, args) -> dict:
    case = CASES[name]
    epochs = case.get("epochs", 1)
    ckpt_dir = Path(args.out).parent / f"{name}-{args.strategy}-tp{args.tp}" if epochs > 1 else None
    losses, trainer = fit(case, args, epochs, ckpt_dir=ckpt_dir)
    result = {"losses": losses, "optimizer": type(trainer.optimizers[0]).__name__, "grad_norms": trainer.grad_norms}
    if args.strategy == "megatron":
        result["expert_state_fraction"] = expert_state_fraction(trainer)
        result["expert_main_offset"] = expert_main_offset(trainer)
        result["expert_main_checksum"] = expert_main_checksum(trainer)
        gathers = getattr(trainer.optimizers[0], "param_gathers", {})  # overlap_param_gather: per buffer
        result["gathers_waited_in_forward"] = [g.num_waited_in_forward for _, g in sorted(gathers.items())]
    if ckpt_dir is not None:  # the same layout; without ZeRO-1 (the saved state is torch's plain format); at ep1
        keys = case.get("resumes", list(RESUMES)) if args.strategy == "megatron" else ["resumed"]
        for key in keys:
            result[key], resumed = fit({**case, **RESUMES[key]}, args, epochs, ckpt_path=str(ckpt_dir / "epoch=0.ckpt"))
            result[f"{key}_expert_main_checksum"] = expert_main_checksum(resumed) if args.strategy == "megatron" else None
    return result


def main() -> None:
    p = layout_parser()
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    run_each(args.cases.split(","), lambda name: train_one(name, args), args.out)


if __name__ == "__main__":
    main()
