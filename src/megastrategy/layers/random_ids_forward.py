"""One eval forward of a Hugging Face model on random inputs (token ids for text models; pixels,
a waveform or mel features for vision and audio models, by the model's ``main_input_name``), the
input that both setup-time block verification and structural plan detection feed a model whose
real data is not known yet."""
from __future__ import annotations

import inspect
import math

import torch
from torch import nn

__all__ = ["SEED", "forward_on_random_ids", "random_main_input"]

SEED = 20240613


def forward_on_random_ids(root: nn.Module) -> None:
    """``root(<main input>=...)`` on a batch of 2 from a private generator (the user's RNG streams
    are untouched), without a key/value cache where the model takes that argument; an
    encoder-decoder gets random ids as ``decoder_input_ids``."""
    config = getattr(root, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 2) or 2)
    gen = torch.Generator().manual_seed(SEED)
    device = next(root.parameters()).device
    ids = torch.randint(3, max(vocab, 4), (2, 8), generator=gen).to(device)
    main = getattr(root, "main_input_name", "input_ids")
    inputs = {main: random_main_input(main, config, gen).to(device)} if main != "input_ids" else {"input_ids": ids}
    if main == "pixel_values" and _takes(root, "spatial_shapes"):  # SigLIP2's patches of variable resolution
        inputs.update(_patch_inputs(_vision_config(config), gen, device))
    # an encoder-decoder (T5, BART, Whisper) runs its decoder on the ids
    extra = {"decoder_input_ids": ids} if getattr(config, "is_encoder_decoder", False) else {}
    if main == "input_ids" and _takes_images(root, config):  # a dual encoder (CLIPModel) reads both
        extra["pixel_values"] = random_main_input("pixel_values", config, gen).to(device)
    with torch.no_grad():
        try:
            root(**inputs, use_cache=False, **extra)
        except TypeError:  # a model without a cache argument
            root(**inputs, **extra)


def random_main_input(name: str, config, gen: torch.Generator) -> torch.Tensor:
    """Standard normal values shaped as the config says the model reads them: images of
    ``image_size`` (ViT, Swin, ConvNeXt), a waveform of 16 frames after the feature extractor's
    strides (Wav2Vec2), ``2 * max_source_positions`` mel frames (Whisper's encoder checks the length)."""
    if name == "pixel_values":
        vision = _vision_config(config)
        size = getattr(vision, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        shape = (2, int(getattr(vision, "num_channels", 3)), h, w)
    elif name == "input_values":
        shape = (2, 16 * math.prod(getattr(config, "conv_stride", (320,))))
    elif name == "input_features":
        shape = (2, int(config.num_mel_bins), 2 * int(config.max_source_positions))
    else:
        raise TypeError(f"no random input for a model whose main input is {name!r}")
    return torch.randn(shape, generator=gen)


def _takes(root: nn.Module, argument: str) -> bool:
    try:
        return argument in inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        return False


def _takes_images(root: nn.Module, config) -> bool:
    """A text-and-image model (CLIP's, SigLIP's dual encoder): its forward takes ``pixel_values``
    besides the ids, and its config sizes the images in a ``vision_config``."""
    return _takes(root, "pixel_values") and getattr(config, "vision_config", None) is not None


def _patch_inputs(vision, gen: torch.Generator, device) -> dict:
    """SigLIP2 reads images as ``num_patches`` flattened patches with their grid (``spatial_shapes``)
    and a mask of real patches: a square grid, every patch real."""
    side = max(1, math.isqrt(int(getattr(vision, "num_patches", 16))))
    width = int(getattr(vision, "num_channels", 3)) * int(getattr(vision, "patch_size", 16)) ** 2
    return {"pixel_values": torch.randn((2, side * side, width), generator=gen).to(device),
            "spatial_shapes": torch.tensor([[side, side]] * 2, device=device),
            "pixel_attention_mask": torch.ones((2, side * side), dtype=torch.long, device=device)}


def _vision_config(config):
    """The config that sizes the images: a composite model's ``vision_config`` (CLIP, SigLIP,
    MetaCLIP-2 keep ``image_size`` there, not on the top-level config), else the config itself."""
    if getattr(config, "image_size", None) is None and getattr(config, "vision_config", None) is not None:
        return config.vision_config
    return config
