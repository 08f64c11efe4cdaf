"""Checks that need only the model and the arguments: run before any process group exists.

Each refusal names the argument or module, the value, the rule and what would work. What can
only be known from a batch (sequence length, masks) is checked when the batch is split.
"""
from __future__ import annotations

import inspect

from torch import nn

from megastrategy.context.hf_integration import SUPPORTED_IMPLEMENTATIONS, hf_configs, hf_pretrained_models
from megastrategy.context.sequence_mixers import check_sequence_mixers
from megastrategy.errors import MegatronConfigError

LAYOUT_CHOICES = ("auto", "balanced", "contiguous")
OUTPUT_CHOICES = ("auto", "tokens", "sequence")
DROPOUT_FIELDS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop")
SEQUENCE_HEADS = ("ForSequenceClassification", "ForMultipleChoice")
INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")
INTERCEPTED = ("scaled_dot_product_attention", *INTERFACE)


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise MegatronConfigError(f"{name}={value!r}: must be one of {choices}.")


def resolve_layout(model: nn.Module, layout: str) -> str:
    """'balanced' for causal attention, 'contiguous' when every attention module is bidirectional."""
    if layout != "auto":
        return layout
    flags = [m.is_causal for m in model.modules() if hasattr(m, "config") and isinstance(getattr(m, "is_causal", None), bool)]
    return "contiguous" if flags and not any(flags) else "balanced"


def resolve_output(model: nn.Module, output: str) -> str:
    """'sequence' for heads that pool the whole sequence (classifiers), else 'tokens'."""
    if output != "auto":
        return output
    heads = [type(m).__name__ for _, m in hf_pretrained_models(model)]
    return "sequence" if any(h.endswith(SEQUENCE_HEADS) for h in heads) else "tokens"


def gather_point(model: nn.Module):
    """``(name, module)`` whose output is gathered in 'sequence' mode: the Hugging Face encoder."""
    for name, hf_model in hf_pretrained_models(model):
        encoder = getattr(getattr(hf_model, "base_model", None), "encoder", None)
        if isinstance(encoder, nn.Module):
            prefix = f"{name}." if name else ""
            inner = next(n for n, m in hf_model.named_modules() if m is encoder)
            return prefix + inner, encoder
    return None


def _check_configs(model: nn.Module) -> None:
    for config in hf_configs(model):
        impl = config._attn_implementation_internal
        if impl not in SUPPORTED_IMPLEMENTATIONS:
            raise MegatronConfigError(
                f"attn_implementation={impl!r} ({type(config).__name__}) with cp > 1: ring attention replaces "
                f"only {[i for i in SUPPORTED_IMPLEMENTATIONS if i]}, whose masks it can reproduce exactly. "
                "Load the model with attn_implementation='sdpa'."
            )
        for field in DROPOUT_FIELDS:
            if (getattr(config, field, 0.0) or 0.0) > 0:
                raise MegatronConfigError(
                    f"{field}={getattr(config, field)} ({type(config).__name__}) with cp > 1: dropout on attention "
                    f"probabilities cannot be reproduced block by block over ranks. Set {field}=0.0."
                )


def _check_attention_modules(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            raise MegatronConfigError(
                f"module '{name}' (nn.MultiheadAttention) with cp > 1: its fused attention cannot be intercepted. "
                "Use a module that calls F.scaled_dot_product_attention, or a Hugging Face model."
            )
        if "attention" not in type(module).__name__.lower() or type(module).__module__.startswith("torch."):
            continue
        source = _class_source(type(module))
        if "_attn_implementation ==" in source and not any(word in source for word in INTERFACE):
            raise MegatronConfigError(
                f"module '{name}' ({type(module).__name__}) picks its attention code by comparing "
                "config._attn_implementation with a name ('sdpa'), so under cp > 1 it takes its hand-written path (a "
                "softmax over local keys with the model's own mask), which cannot see keys on other cp ranks. Ring "
                "attention is reached through the Hugging Face attention interface or an unmasked "
                "F.scaled_dot_product_attention call; use cp=1 for this model."
            )
        if "softmax" in source and not any(word in source for word in INTERCEPTED):
            raise MegatronConfigError(
                f"module '{name}' ({type(module).__name__}) computes attention with an explicit softmax, which cannot "
                "see keys on other cp ranks. Call torch.nn.functional.scaled_dot_product_attention instead."
            )


def _class_source(cls: type) -> str:
    """The source of ``cls`` and its own bases (not torch's): the softmax may sit in a helper method
    (GPT-Neo's ``_attn``), which checking ``forward`` alone found only at the first step."""
    parts = []
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")):
            continue
        try:
            parts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
    return "\n".join(parts)


def validate(model: nn.Module, cp: int, layout: str = "auto", output: str = "auto") -> None:
    """Raise :class:`MegatronConfigError` if ``model`` cannot run exactly with context parallelism ``cp``."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise MegatronConfigError(f"cp={cp!r} must be a positive integer.")
    _choice("layout", layout, LAYOUT_CHOICES)
    _choice("output", output, OUTPUT_CHOICES)
    if cp == 1:
        return
    _check_configs(model)
    check_sequence_mixers(model)
    _check_attention_modules(model)
    if resolve_output(model, output) == "sequence" and gather_point(model) is None:
        raise MegatronConfigError(
            f"output={output!r} resolves to 'sequence' (the head pools the whole sequence), which needs a Hugging Face "
            "encoder whose output can be gathered; none was found. Use output='tokens' with a token-level loss."
        )
