"""The steps users write around a Hugging Face causal LM held in ``self.model``: loss from
``labels=`` (the input ids), logged as ``train_loss`` / ``val_loss``; AdamW over the trainable
parameters."""
from __future__ import annotations

import lightning as L
import torch


class CausalLMSteps(L.LightningModule):
    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def tiny_llama_config():
    """4 layers, hidden 32, 4 heads in 2 key/value groups, vocab 64."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)


def random_token_rows(rows: int = 64, length: int = 16, vocab: int = 64) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0)))
