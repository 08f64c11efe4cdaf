"""Inputs for blocks outside a Hugging Face model (a hand-written GPT, LitGPT, ``torch.nn``
layers), so that setup-time block verification covers them too.

A user's ``tp_plan`` on such a model is shape-consistent but can still be wrong for its forward:
nanoGPT's attention does ``y.view(B, T, C)`` with the full embedding size, which fails on the
local heads deep in the first training step. Running the block once here turns that into a clear
refusal in setup. There is no config saying what the model reads, so the input is guessed,
innermost module first, and only modules whose ``forward`` takes exactly one required positional
argument are tried: the block itself (or an ancestor without an embedding) on random hidden
states as wide as its first ``column`` layer's input, an ancestor holding an ``nn.Embedding`` on
random token ids below that embedding's size (LitGPT's attention needs rotary tables, so its
``GPT`` runs). A guess that raises on the *unsharded* model is just a wrong guess: the next
ancestor is tried, and a block no guess reaches stays unverified, as before. Eval mode, no grad,
a private generator: nothing the user sees changes.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from megastrategy.layers.plan.resolved import PlanEntry
from megastrategy.layers.random_ids_forward import SEED

__all__ = ["capture_plain_inputs", "runnable_guess"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _takes_one_argument(m: nn.Module) -> bool:
    """``m.forward`` is implemented and needs exactly one positional argument (and no keyword)."""
    if type(m).forward is nn.Module.forward:
        return False
    try:
        params = inspect.signature(m.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(required) == 1 and required[0].kind in _POSITIONAL


def _width(block: nn.Module, name: str, entries: list[PlanEntry]) -> Optional[int]:
    """Input width of the block's first column layer (``in_features``, ``embed_dim``, or the
    weight's last dimension)."""
    for e in entries:
        if e.style in ("column", "attention"):
            m = block.get_submodule(e.name[len(name) + 1:] if name else e.name)
            for attr in ("in_features", "embed_dim"):
                if isinstance(getattr(m, attr, None), int):
                    return getattr(m, attr)
            w = getattr(m, "weight", None)
            return int(w.shape[-1]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None
    return None


def _guess(candidate: nn.Module, is_block: bool, width: Optional[int], gen: torch.Generator):
    """Random input for ``candidate``: token ids if it holds an embedding (and is not the block),
    hidden states of ``width`` otherwise; None when neither applies."""
    param = next((p for p in candidate.parameters() if p.is_floating_point()), None)
    if param is None:
        return None
    emb = None if is_block else next((m for m in candidate.modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:
        return torch.randint(0, emb.num_embeddings, (2, 8), generator=gen).to(param.device)
    if width is None:
        return None
    return torch.randn((2, 8, width), generator=gen).to(device=param.device, dtype=param.dtype)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _first_call(root: nn.Module, block: nn.Module, x: torch.Tensor) -> Optional[tuple[tuple, dict]]:
    """The (args, kwargs) ``block`` first receives when ``root(x)`` runs, or None if it raises."""
    seen: list[tuple[tuple, dict]] = []
    handle = block.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)) if not seen else None,
                                             with_kwargs=True)
    try:
        with torch.no_grad():
            root(x)
    except Exception:  # noqa: BLE001 - a wrong guess of what the model reads: try the next ancestor
        pass
    finally:
        handle.remove()
    return seen[0] if seen else None


def capture_plain_inputs(
    module: nn.Module, blocks: dict[str, list[PlanEntry]], detach: Callable[[Any], Any]
) -> dict[str, tuple[tuple, dict]]:
    """Block name -> the (detached) inputs it receives on a guessed random input (module in eval
    mode, set by the caller); blocks no guess reaches are left out."""
    out = {}
    for name, entries in blocks.items():
        block = module.get_submodule(name)
        width = _width(block, name, entries)
        for anc in _ancestors(name):
            candidate = module.get_submodule(anc)
            if not _takes_one_argument(candidate):
                continue
            x = _guess(candidate, anc == name, width, torch.Generator().manual_seed(SEED))
            got = None if x is None else _first_call(candidate, block, x)
            if got is not None:
                out[name] = detach(got)
                break
    return out


def runnable_guess(
    module: nn.Module, name: str, width: Optional[int], with_embedding: bool = False
) -> Optional[tuple[str, torch.Tensor]]:
    """The innermost ancestor of ``name`` (itself included; with ``with_embedding``, one holding an
    ``nn.Embedding``) that runs without raising on its guessed input, and that input: what
    structural detection traces a user's layer stack with (:mod:`megastrategy.layers.user_stack_plans`).
    Eval mode and no grad (training flags restored)."""
    for anc in _ancestors(name):
        candidate = module.get_submodule(anc)
        if not _takes_one_argument(candidate):
            continue
        if with_embedding and not any(isinstance(m, nn.Embedding) for m in candidate.modules()):
            continue
        x = _guess(candidate, False, width, torch.Generator().manual_seed(SEED))
        if x is not None and _runs(candidate, x):
            return anc, x
    return None


def _runs(candidate: nn.Module, x: torch.Tensor) -> bool:
    flags = {m: m.training for m in candidate.modules()}
    candidate.eval()
    try:
        with torch.no_grad():
            candidate(x)
        return True
    except Exception:  # noqa: BLE001 - a wrong guess of what the model reads: try the next ancestor
        return False
    finally:
        for m, mode in flags.items():
            m.training = mode
