"""Module hooks that keep the user's model unchanged yet consistent with a split sequence.

* Inputs: a model that takes ``position_ids`` but got none would number the local tokens
  0..local_len-1; the hook passes their global positions (numbered like the model does,
  positions.py), and makes global a run the model numbered itself from the local length.
  A Hugging Face causal LM given ``labels`` also gets ``shift_labels`` shifted on the global
  sequence.
* Cache: a training forward builds no KV cache (``use_cache=False`` where the model takes it). It
  would hold only this rank's keys, and a checkpoint's replay (recompute.py) appends the block's
  keys to it a second time, so the replayed attention saw twice the local keys.
* Gather: where the model pools the whole sequence, the hook replaces the hidden states with
  the gathered sequence.
* Tracker: the running module's name, so refusals say where attention was computed.

Every hook does nothing while no split microbatch is active.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch
from torch import nn

from megastrategy.context.attention_dispatch import ActiveSplit
from megastrategy.context.hf_integration import causal_lm_loss
from megastrategy.context.positions import globalize

GetSplit = Callable[[], Optional[ActiveSplit]]


def _var_keyword(signature: inspect.Signature) -> Optional[str]:
    return next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def _set_argument(bound: inspect.BoundArguments, signature, name: str, value) -> None:
    if name in signature.parameters:
        bound.arguments[name] = value
    else:
        bound.arguments.setdefault(_var_keyword(signature), {})[name] = value


def input_hook(get_split: GetSplit, module: nn.Module) -> Callable:
    signature = inspect.signature(module.forward)
    causal_lm = causal_lm_loss(module)
    takes_shift = "shift_labels" in signature.parameters or _var_keyword(signature) is not None
    takes_cache = "use_cache" in signature.parameters

    def hook(_module, args, kwargs):
        split = get_split()
        if split is None:
            return None
        bound = signature.bind_partial(*args, **kwargs)
        state = split.state
        given = bound.arguments.get("position_ids")
        if given is None:
            ids = state.row_positions if state.row_positions is not None else state.positions[None].expand(state.batch_size, -1)
            _set_argument(bound, signature, "position_ids", ids)
        else:  # numbered by the model from the local length (a BART decoder): made global
            bound.arguments["position_ids"] = globalize(given, state.positions)
        if takes_cache and state.training:
            bound.arguments["use_cache"] = False
        labels = bound.arguments.get("labels")
        if causal_lm and takes_shift and state.shift_labels is not None and isinstance(labels, torch.Tensor):
            if labels.shape == state.shift_labels.shape:
                _set_argument(bound, signature, "shift_labels", state.shift_labels.to(labels.device))
        return _call_arguments(bound, signature)

    return hook


def _call_arguments(bound: inspect.BoundArguments, signature: inspect.Signature) -> tuple[tuple, dict]:
    """``(args, kwargs)`` passing by keyword whatever may be: transformers' decorators (Whisper's
    ``merge_with_config_defaults``) add keyword arguments, which collided with the same argument
    re-passed by position ("got multiple values for argument 'use_cache'")."""
    kinds = {name: p.kind for name, p in signature.parameters.items()}
    if inspect.Parameter.VAR_POSITIONAL in kinds.values():
        return bound.args, bound.kwargs
    args, kwargs = [], {}
    for name, value in bound.arguments.items():
        if kinds[name] is inspect.Parameter.POSITIONAL_ONLY:
            args.append(value)
        elif kinds[name] is inspect.Parameter.VAR_KEYWORD:
            kwargs.update(value)
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def input_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose forward takes ``position_ids``."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        try:
            takes = "position_ids" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if takes and not any(outer == "" or name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return [module for _, module in found]


def gather_hook(get_split: GetSplit, gather: Callable) -> Callable:
    """Forward hook replacing the first output (tensor, tuple or ModelOutput) with its gathered sequence."""

    def hook(_module, _args, output):
        if get_split() is None:
            return None
        if isinstance(output, torch.Tensor):
            return gather(output)
        if hasattr(output, "keys") and hasattr(output, "__setitem__"):
            first = next(iter(output.keys()))
            output[first] = gather(output[first])
            return output
        return (gather(output[0]), *output[1:])

    return hook


def install_tracker(model: nn.Module, get_split: GetSplit) -> list:
    """Pre/post hooks that record the running module's qualified name and class in ``split.where``."""
    handles = []
    for name, module in model.named_modules():
        label = f"module '{name or '<root>'}' ({type(module).__name__})"

        def enter(_m, _a, label=label):
            split = get_split()
            if split is not None:
                split.stack.append(split.where)
                split.where = label

        def leave(_m, _a, _o):
            split = get_split()
            if split is not None and split.stack:
                split.where = split.stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    return handles
