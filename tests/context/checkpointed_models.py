"""Models that recompute activations the ways users do, for the cp recompute tests (fp32, dropout off).

* ``checkpoint_blocks(model, reentrant)``: the user's own ``torch.utils.checkpoint`` around every
  block of the layer stack (a hand-written GPT's ``blocks`` or a Hugging Face model's ``layers``).
  Hugging Face blocks get the mask positionally under the reentrant checkpoint, which detaches
  every positional argument before the replay (the mask marker must still be recognised).
* ``hf_gradient_checkpointing(model, reentrant)``: ``model.gradient_checkpointing_enable()``.
* ``count_attention_calls(model, suffix)``: attention modules' calls, replays included (is the
  recompute real?).
"""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


class UserCheckpointedBlock(nn.Module):
    """``checkpoint(block, x, ...)`` in the forward, as the memory tutorials write it."""

    def __init__(self, block: nn.Module, reentrant: bool):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, hidden, *args, **kwargs):
        if not self.training:
            return self.block(hidden, *args, **kwargs)
        if not self.reentrant:
            return checkpoint(self.block, hidden, *args, use_reentrant=False, **kwargs)
        mask = kwargs.pop("attention_mask", None)
        if mask is None:
            return checkpoint(functools.partial(self.block, **kwargs), hidden, *args, use_reentrant=True)

        def run(h, m):
            return self.block(h, attention_mask=m, **kwargs)

        return checkpoint(run, hidden, mask, use_reentrant=True)


def _stack(model: nn.Module) -> nn.ModuleList:
    for name in ("blocks", "layers"):
        for module in model.modules():
            stack = getattr(module, name, None)
            if isinstance(stack, nn.ModuleList):
                return stack
    raise ValueError(f"no block stack in {type(model).__name__}")


def checkpoint_blocks(model: nn.Module, reentrant: bool) -> nn.Module:
    stack = _stack(model)
    for i, block in enumerate(stack):
        stack[i] = UserCheckpointedBlock(block, reentrant)
    return model


def hf_gradient_checkpointing(model: nn.Module, reentrant: bool) -> nn.Module:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def count_attention_calls(model: nn.Module, suffix: str) -> list[int]:
    """A one-element list counting calls, while training, of the modules whose name ends with ``suffix``
    (inside the blocks: the strategy's recompute keeps a block's own hooks outside its checkpoint)."""
    calls = [0]

    def count(module, _args):
        if module.training:
            calls[0] += 1

    for name, module in model.named_modules():
        if name.endswith(suffix):
            module.register_forward_pre_hook(count)
    return calls
