"""Structural plans for a user's own transformer (nanoGPT, minGPT, a hand-written Llama): the
layer stack of a model that is neither Hugging Face nor of a class this project knows.

Without this, auto-detection at ``tp > 1`` refused such a model ("recognized no known block"),
although its blocks are built the way structural detection
(:mod:`megastrategy.layers.structural_plans`) reads Hugging Face models: which linear layer
feeds which, heads from an attribute such as ``n_head``. So the same dataflow probe runs here,
on a guessed input (:func:`megastrategy.layers.plain_block_inputs.runnable_guess`: token ids
below the embedding's size for the innermost ancestor of the stack that runs on them), over
the model's layer stack (:func:`megastrategy.anatomy.find_layer_stack`). MLPs become column/row
and attentions head-sharded where the reading is unambiguous.

The token embedding and the output head become vocab-parallel only where that is exact
(:mod:`megastrategy.layers.user_vocab`: their weights are used by nothing but their own calls);
otherwise they stay replicated. An attention whose
forward cannot run on its local heads (nanoGPT reads ``C`` from ``x.size()``) is caught by the
setup-time block check and kept whole (:mod:`megastrategy.layers.block_fallback`). Pure:
nothing is modified (the probe runs in eval mode, without grad, on a private generator).
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from megastrategy.anatomy import find_layer_stack
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.structural_plans import structural_units
from megastrategy.layers.unit_types import BuiltinUnit, Refusal, is_hf_pretrained, is_linear_layer
from megastrategy.layers.user_vocab import vocab_units
from megastrategy.naming import join_name

__all__ = ["user_stack_units"]


def _user_stack(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The layer stack of ``module`` if it holds blocks (containers) outside any Hugging Face
    model, else None."""
    try:
        path, stack = find_layer_stack(module)
    except MegatronConfigError:
        return None
    if len(stack) == 0 or not any(True for _ in stack[0].children()):
        return None
    for name, m in module.named_modules():
        if is_hf_pretrained(m) and (name == "" or path == name or path.startswith(name + ".")):
            return None
    return path, stack


def _first_width(stack: nn.Module) -> Optional[int]:
    """Input width of the first linear layer of the first block: the hidden size, for a guess of
    hidden states where the model has no embedding."""
    layer = next((m for m in stack[0].modules() if is_linear_layer(m)), None)
    width = getattr(layer, "in_features", None)
    return width if isinstance(width, int) else None


def user_stack_units(module: nn.Module, covered: set[str]) -> tuple[list[BuiltinUnit], list[Refusal]]:
    """Units found by tracing the user's layer stack (names relative to ``module``); nothing when
    another source already names one of its linear layers (LitGPT, timm, ``torch.nn`` layers)."""
    found = _user_stack(module)
    if found is None:
        return [], []
    path, stack = found
    linears = [join_name(path, n) for n, m in stack.named_modules() if is_linear_layer(m)]
    if not linears or any(n in covered for n in linears):
        return [], []
    # imported here: plain_block_inputs reads the plan types, whose package imports this module
    from megastrategy.layers.plain_block_inputs import runnable_guess

    guess = runnable_guess(module, path, _first_width(stack))
    if guess is None:
        return [], []
    root_name, x = guess
    root = _sub(module, root_name)
    units, refused = structural_units(root_name, root, covered, run=lambda: root(x), with_vocab=False)
    arch = _model_class(module, path)
    for u in units:  # named after the user's model, not the container that was traced (nn.Sequential)
        u.arch = arch
    if units:
        units += _vocab(module, path, arch, covered, guess)
    return units, refused


def _vocab(module: nn.Module, path: str, arch: str, covered: set[str], traced) -> list[BuiltinUnit]:
    """Vocab-parallel embedding and head where exact (:mod:`megastrategy.layers.user_vocab`), watched
    on the traced root's input if it holds the embedding, else from the innermost ancestor of the
    stack that holds one and runs on token ids (minGPT's stack, an ``nn.Sequential``, ran on hidden
    states)."""
    from megastrategy.layers.plain_block_inputs import runnable_guess

    root_name, x = traced
    if not any(isinstance(m, nn.Embedding) for m in _sub(module, root_name).modules()):
        found = runnable_guess(module, path, None, with_embedding=True)
        if found is None:
            return []
        root_name, x = found
    root = _sub(module, root_name)
    return vocab_units(root_name, root, arch, covered, lambda: root(x))


def _sub(module: nn.Module, name: str) -> nn.Module:
    return module.get_submodule(name) if name else module


def _model_class(module: nn.Module, path: str) -> str:
    """The class name of the nearest ancestor of ``path`` that is not a ``torch.nn`` container."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        m = module.get_submodule(".".join(parts[:i])) if i else module
        if not type(m).__module__.startswith("torch."):
            return type(m).__name__
    return type(module).__name__
