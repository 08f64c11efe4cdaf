"""Train a matrix of tiny Hugging Face architectures, one after the other, in one launch.

Each model sits in an ordinary LightningModule whose step passes ``labels=`` to the model so the
loss is computed inside it. Rank 0 writes ``{model: [per-step train_loss]}`` to ``--out``.
Launched on N processes by tests/helpers/launch.py (``--strategy ddp`` on one is the reference).
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

VOCAB, SEQ, LAYERS = 128, 12, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CLS, LM = "AutoModelForSequenceClassification", "AutoModelForCausalLM"
GQA = dict(num_key_value_heads=2, head_dim=8)
ARCHITECTURES = {  # name: (config class, auto class, config arguments beyond COMMON)
    "bert": ("BertConfig", CLS, {}),
    "roberta": ("RobertaConfig", CLS, {}),
    "xlm-roberta": ("XLMRobertaConfig", CLS, {}),
    "distilbert": ("DistilBertConfig", CLS, dict(dim=32, n_layers=LAYERS, n_heads=4, hidden_dim=64)),
    "electra": ("ElectraConfig", CLS, dict(embedding_size=16)),
    "albert": ("AlbertConfig", CLS, dict(embedding_size=16)),
    "opt": ("OPTConfig", LM, dict(ffn_dim=64, word_embed_proj_dim=32)),
    "gpt2": ("GPT2Config", LM, dict(n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64)),
    "gpt-neox": ("GPTNeoXConfig", LM, {}),
    "llama": ("LlamaConfig", LM, dict(num_key_value_heads=2)),
    "gemma": ("GemmaConfig", LM, dict(num_key_value_heads=2, head_dim=8)),
    "phi3": ("Phi3Config", LM, dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", LM, dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", LM, dict(num_key_value_heads=2)),
    "camembert": ("CamembertConfig", CLS, {}),
    "modernbert": ("ModernBertConfig", CLS, dict(global_attn_every_n_layers=2, local_attention=8, cls_token_id=1,
                                                 sep_token_id=2)),
    # decoders that declare ``base_model_tp_plan``
    "qwen3": ("Qwen3Config", LM, GQA),
    "gemma2": ("Gemma2Config", LM, GQA),
    "phi": ("PhiConfig", LM, dict(partial_rotary_factor=0.5)),
    "olmo": ("OlmoConfig", LM, GQA),
    "olmo2": ("Olmo2Config", LM, GQA),
    "granite": ("GraniteConfig", LM, GQA),
    "cohere": ("CohereConfig", LM, GQA),
    "starcoder2": ("Starcoder2Config", LM, GQA),
    "glm": ("GlmConfig", LM, GQA),
    "helium": ("HeliumConfig", LM, GQA),
    "smollm3": ("SmolLM3Config", LM, GQA),
    "stablelm": ("StableLmConfig", LM, dict(num_key_value_heads=2)),
    # decoders that declare no plan: Falcon's grouped-query layout, Persimmon's per-head q/k norms
    "falcon": ("FalconConfig", LM, dict(new_decoder_architecture=True, num_attention_heads=8, num_kv_heads=2,
                                        alibi=False)),
    "persimmon": ("PersimmonConfig", LM, dict(qk_layernorm=True)),
    # its encoder calls ``layer.forward(...)`` (no hooks) and its blocks return a dict
    "squeezebert": ("SqueezeBertConfig", CLS, dict(embedding_size=32)),
    # no loss of its own: the module adds a head (its blocks hand each other T5's position bias)
    "t5-encoder": ("T5Config", "T5EncoderModel", dict(d_model=32, d_ff=64, num_layers=LAYERS, num_heads=4, d_kv=8)),
}


def build_config(name: str):
    config_cls, _, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra}, num_labels=3)
    for key, value in config.to_dict().items():  # dropout off: the comparison is exact
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    return config


class Tokens(Dataset):
    def __init__(self, n: int = 32, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "label": self.labels[i]}


class HFModule(L.LightningModule):
    """What a user writes: the Hugging Face model computes its own loss from ``labels``."""

    def __init__(self, name: str):
        super().__init__()
        self.causal = ARCHITECTURES[name][1] == LM
        cls = getattr(transformers, ARCHITECTURES[name][1])
        self.model = cls.from_config(build_config(name)) if cls.__name__.startswith("Auto") else cls(build_config(name))
        self.head = torch.nn.Linear(32, 3) if name == "t5-encoder" else None

    def training_step(self, batch, batch_idx):
        if self.head is not None:  # an encoder without a loss: the user's own head and loss
            hidden = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            loss = torch.nn.functional.cross_entropy(self.head(hidden.mean(1)), batch["label"])
            self.log("train_loss", loss)
            return loss
        labels = batch["input_ids"] if self.causal else batch["label"]
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
        self.log("train_loss", out.loss)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-2)

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=4)


def train(name: str, args) -> list[float]:
    L.seed_everything(7, verbose=False)
    module = HFModule(name)
    if args.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(pp=args.pp, vp=args.vp, heartbeat_timeout=60.0)
    losses = step_losses_callback()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        callbacks=[losses], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(module)
    return losses.losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp", "megatron"], required=True)
    p.add_argument("--models", required=True, help="comma-separated names of ARCHITECTURES")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--vp", type=int, default=None)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    args.devices = int(os.environ["WORLD_SIZE"])  # read once: a fit may change it
    torch.set_num_threads(1)
    run_each(args.models.split(","), lambda name: train(name, args), args.out)


if __name__ == "__main__":
    main()
