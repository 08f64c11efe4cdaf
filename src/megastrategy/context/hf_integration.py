"""Select ring attention in Hugging Face models through their own attention interface.

transformers 5.x looks attention up by ``config._attn_implementation`` in
``ALL_ATTENTION_FUNCTIONS``. Each :class:`HFAttentionSwitch` registers one function under its
own key and points the model's configs at it only while a split microbatch runs, so outside the
forward context the model is exactly the user's. The key's mask function builds no (local, hence
wrong) mask: it classifies the model's mask rule on global positions (hf_masks.py), and the ring
builds the masks from global positions.
"""
from __future__ import annotations

import inspect
from typing import Callable

from torch import nn

SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", None)


def hf_configs(model: nn.Module) -> list:
    """Distinct Hugging Face configs reachable from the model's modules."""
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def hf_pretrained_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost Hugging Face models inside ``model`` (the model itself, or inside a LightningModule)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if hasattr(module, "config") and hasattr(module, "base_model_prefix"):
            if not any(name.startswith(outer + ".") or outer == "" for outer, _ in found):
                found.append((name, module))
    return found


def causal_lm_loss(module: nn.Module) -> bool:
    """Whether a Hugging Face model computes its ``labels=`` loss with transformers' causal-LM loss,
    which shifts the labels by one inside: under cp that shift must happen on the global sequence.

    Decided by the function ``loss_type`` resolves to, not its name: ``ForConditionalGeneration``
    (vision/audio-language models) resolves to the causal-LM loss too, and classes whose name
    matches no loss (GPT-2's ``*LMHeadModel``) have ``loss_type`` None and fall back to it when
    their forward calls ``self.loss_function``. Missing either split the targets per rank: a
    silent loss difference at cp2 (GPT-2 1.6e-2, MossTranscribeDiarize 8e-3).
    """
    if not hasattr(module, "config") or not hasattr(module, "loss_type"):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING

    causal = LOSS_MAPPING["ForCausalLM"]
    if getattr(module, "_loss_function", None) is not None:
        return module._loss_function is causal
    if module.loss_type in LOSS_MAPPING:
        return LOSS_MAPPING[module.loss_type] is causal
    try:
        return "self.loss_function(" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False


class _PackingDetection:
    """transformers reads packed sequences off ``position_ids`` that jump (when there is no cache and no
    2-D mask) and adds a mask that hides keys across the jump. Under cp the global positions of a
    rank jump between its two chunks, so that detection would fire on every split (Llama with
    ``use_cache=False``); packed batches are refused before the split (``check_position_ids``), so
    inside the forward context the detection is switched off."""

    saved: list = []

    @classmethod
    def off(cls) -> None:
        from transformers import masking_utils

        cls.saved.append(masking_utils.find_packed_sequence_indices)
        masking_utils.find_packed_sequence_indices = _no_packed_sequences

    @classmethod
    def restore(cls) -> None:
        from transformers import masking_utils

        if cls.saved:
            masking_utils.find_packed_sequence_indices = cls.saved.pop()


def _no_packed_sequences(position_ids):
    return None


class HFAttentionSwitch:
    """Registers ``function`` (attention) and ``mask_function`` (the masks transformers builds for it)
    under a key of its own; :meth:`enter`/:meth:`exit` switch the configs."""

    def __init__(self, model: nn.Module, function: Callable, mask_function: Callable):
        self.configs = hf_configs(model)
        self.key = f"megastrategy_context_parallel_{id(self):x}"
        self.saved: list[tuple[object, object]] = []
        if self.configs:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface

            AttentionInterface.register(self.key, function)
            AttentionMaskInterface.register(self.key, mask_function)

    def enter(self) -> None:
        self.saved = [(config, config._attn_implementation_internal) for config in self.configs]
        for config, _ in self.saved:
            config._attn_implementation_internal = self.key
        if self.configs:
            _PackingDetection.off()

    def exit(self) -> None:
        for config, original in self.saved:
            config._attn_implementation_internal = original
        if self.saved:
            _PackingDetection.restore()
        self.saved = []

    def remove(self) -> None:
        self.exit()
        if self.configs:
            from transformers import AttentionInterface

            from transformers.masking_utils import AttentionMaskInterface

            AttentionInterface._global_mapping.pop(self.key, None)
            AttentionMaskInterface._global_mapping.pop(self.key, None)
