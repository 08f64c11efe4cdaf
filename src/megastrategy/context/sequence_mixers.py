"""Refuse, before any process group, models that mix tokens by something other than attention.

Why: context parallelism makes *attention* see the whole sequence (the ring) and leaves every
other layer on the rank's own tokens, which is exact only for layers that act on each token
alone (linear layers, norms, MLPs, experts). A layer that carries information along the
sequence any other way -- a causal convolution (Mamba, gated DeltaNet, LFM short convs), a
recurrence or state-space scan, linear attention, a time shift (RWKV) -- would silently see only
this rank's chunk: the cp2 sweep measured such models 3e-4..9e-2 off one device, and some
within the 2e-4 tolerance only because tiny random weights keep the mixer's output small
(Jamba 4.6e-5), so no tolerance can be the check. Three structural signs, each named in the
refusal:

* a config's per-layer kinds (``layer_types`` / ``layers_block_type``) name a mixer other
  than attention (``linear_attention``, ``mamba``, ``conv``, ``hybrid``, ...);
* a module that mixes neighbouring positions: ``nn.Conv1d`` with a kernel wider than 1, an
  ``nn.RNNBase``, a padding module (a shift along the sequence);
* a Hugging Face model without any attention module at all (xLSTM).
"""
from __future__ import annotations

import inspect

from torch import nn

from megastrategy.context.hf_integration import hf_configs, hf_pretrained_models
from megastrategy.errors import MegatronConfigError

LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")
#: substrings of a layer kind that mean "mixes tokens without softmax attention"
MIXER_WORDS = ("linear", "mamba", "conv", "recurrent", "rnn", "ssm", "hybrid", "delta", "lstm", "rwkv", "lightning")
ATTENTION_CALLS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "scaled_dot_product_attention", "softmax")
SHIFTS = (nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d)
WORKS = ("Context parallelism splits the sequence exactly only through attention; train this model with cp=1 "
         "(tensor, pipeline or data parallelism work).")


def check_sequence_mixers(model: nn.Module) -> None:
    """Raise :class:`MegatronConfigError` naming the first non-attention sequence mixer found."""
    for config in hf_configs(model):
        _check_layer_kinds(config)
    for name, module in model.named_modules():
        why = _mixes_neighbours(module)
        if why:
            raise MegatronConfigError(
                f"module '{name}' ({type(module).__name__}{why}) with cp > 1: it mixes each token with its "
                "neighbours along the sequence, and the neighbours before this rank's chunk are on another cp rank, "
                f"so every rank would compute a different model. {WORKS}"
            )
    for name, hf_model in hf_pretrained_models(model):
        if not any(_is_attention(m) for m in hf_model.modules()):
            raise MegatronConfigError(
                f"'{name or type(hf_model).__name__}' ({type(hf_model).__name__}) with cp > 1 has no attention module: "
                f"its tokens are mixed by something else (a recurrence or scan), which sees only this rank's chunk. {WORKS}"
            )


def _check_layer_kinds(config) -> None:
    for field in LAYER_KIND_FIELDS:
        kinds = getattr(config, field, None)
        if not isinstance(kinds, (list, tuple)):
            continue
        for index, kind in enumerate(kinds):
            if isinstance(kind, str) and any(word in kind.lower() for word in MIXER_WORDS):
                raise MegatronConfigError(
                    f"{field}[{index}]={kind!r} ({type(config).__name__}) with cp > 1: that layer mixes tokens without "
                    "softmax attention (linear attention, a state-space scan, a convolution), carrying state along the "
                    f"whole sequence, and a rank holds only its chunk of it. {WORKS}"
                )


def _mixes_neighbours(module: nn.Module) -> str:
    """A short description when ``module`` mixes neighbouring positions, else ''."""
    if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
        return f", kernel_size={module.kernel_size[0]}"
    if isinstance(module, nn.RNNBase):
        return ", a recurrence"
    if isinstance(module, SHIFTS):
        return ", a shift along the sequence"
    return ""


def _is_attention(module: nn.Module) -> bool:
    """Named like attention, or its forward computes one (LongCat's attention class is '...MLA')."""
    name = type(module).__name__.lower()
    if "attention" in name or "attn" in name:
        return True
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return any(word in source for word in ATTENTION_CALLS)
