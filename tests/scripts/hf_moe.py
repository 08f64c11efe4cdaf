"""Hugging Face MoE decoders (fused experts) trained as a user writes them, on N processes.

One launch trains every model of ``MODELS`` a few steps under ``DDPStrategy`` or
``MegatronStrategy(ep=...)``, then saves a checkpoint. Rank 0 writes the per-step losses and the
final weights (DDP: the module's state_dict; ours: consolidated from the sharded checkpoint) to
``--out``-beside files, so the test compares training and the EP checkpoint's reassembly.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.helpers.script_args import layout_parser, leave_without_static_destructors  # noqa: E402

VOCAB, SEQ = 128, 16
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False)
MODELS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=32, moe_intermediate_size=16, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    # experts in their own layout (gate_up_proj [E, H, 2F], biases, interleaved gate/up): run by their own code
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=16, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    # latent attention, a shared expert beside the routed ones, the first layer dense
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=32, moe_intermediate_size=16, q_lora_rank=16,
                                             kv_lora_rank=16, qk_rope_head_dim=4, head_dim=4, qk_nope_head_dim=8,
                                             v_head_dim=8, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                                             num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1)),
}


class CausalLM(L.LightningModule):
    """An ordinary module: the Hugging Face model computes its loss (and the router's aux loss) from ``labels``."""

    def __init__(self, arch: str, layers: int = 2, call_router_logits: bool = False):
        super().__init__()
        import transformers

        name, extra = MODELS[arch]
        config = getattr(transformers, name)(**{**_SMALL, **extra, "num_hidden_layers": layers})
        config.output_router_logits = not call_router_logits
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.call_router_logits = call_router_logits

    def training_step(self, batch, batch_idx):
        asked = {"output_router_logits": True} if self.call_router_logits else {}
        loss = self.model(input_ids=batch, labels=batch, **asked).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # plain SGD: unlike Adam it is sensitive to the gradient's scale, so a mis-scaled expert gradient shows
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        data = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(7))
        return DataLoader(list(data), batch_size=2)


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def train(arch: str, strategy, ckpt: Path, devices: int, args) -> tuple[list[float], L.LightningModule, L.Trainer]:
    L.seed_everything(0)
    module, recorder = CausalLM(arch, args.layers, args.call_router_logits), LossRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[recorder])
    trainer.fit(module)
    trainer.save_checkpoint(ckpt)
    return recorder.losses, module, trainer


def main() -> None:
    p = layout_parser()
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated keys of MODELS")
    p.add_argument("--microbatches", type=int, default=None, help="num_microbatches under pp > 1")
    p.add_argument("--layers", type=int, default=2, help="num_hidden_layers (pp3 needs 3: a middle stage)")
    p.add_argument("--call-router-logits", action="store_true",
                   help="config.output_router_logits=False, the step passes output_router_logits=True itself")
    args = p.parse_args()
    out = Path(args.out)
    devices, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # Lightning's teardown removes them
    results = {}
    for arch in args.models.split(","):
        if args.strategy == "ddp":
            strategy = DDPStrategy(process_group_backend="gloo")
        else:
            from megastrategy import MegatronStrategy

            strategy = MegatronStrategy(tp=args.tp, ep=args.ep, etp=1, pp=args.pp, num_microbatches=args.microbatches)
        ckpt = out.parent / f"{arch}-{args.strategy}-tp{args.tp}-pp{args.pp}.ckpt"
        losses, module, trainer = train(arch, strategy, ckpt, devices, args)
        results[arch] = {"losses": losses, "checkpoint": str(ckpt),
                         "local_experts": [tuple(p.shape) for n, p in module.named_parameters() if "gate_up_proj" in n][:1],
                         "q_proj": [tuple(p.shape) for n, p in module.named_parameters() if "q_proj.weight" in n][:1]}
    if rank == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    leave_without_static_destructors()
