"""One eval forward of a Hugging Face model on random token ids, the input that both setup-time
block verification and structural plan detection feed a model whose real data is not known yet."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["SEED", "forward_on_random_ids"]

SEED = 20240613


def forward_on_random_ids(root: nn.Module) -> None:
    """``root(input_ids=...)`` on a [2, 8] batch from a private generator (the user's RNG streams
    are untouched), without a key/value cache where the model takes that argument; an
    encoder-decoder gets the same ids as ``decoder_input_ids``."""
    config = getattr(root, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 2))
    gen = torch.Generator().manual_seed(SEED)
    device = next(root.parameters()).device
    ids = torch.randint(3, max(vocab, 4), (2, 8), generator=gen).to(device)
    # an encoder-decoder (T5, BART) runs its decoder on the same ids
    extra = {"decoder_input_ids": ids} if getattr(config, "is_encoder_decoder", False) else {}
    with torch.no_grad():
        try:
            root(input_ids=ids, use_cache=False, **extra)
        except TypeError:  # a model without a cache argument
            root(input_ids=ids, **extra)
