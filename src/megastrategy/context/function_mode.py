"""A torch function mode, active only inside the forward context, that redirects the calls a
split sequence changes: ``scaled_dot_product_attention`` (to ring attention), token losses (to
the global mean over cp ranks) and a softmax over a local ``(seq × seq)`` score matrix, which is
attention computed by hand and cannot be split: it is refused, naming the module, as is an
operation that fails on the empty mask marker (hf_masks.py): code reading the mask itself.

A mode catches the call however the user imported the function, and leaves the model's code
and torch's module attributes untouched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megastrategy.context.attention_dispatch import ActiveSplit, sdpa_attention
from megastrategy.context.token_loss import global_token_loss
from megastrategy.errors import MegatronConfigError

SOFTMAX_FUNCTIONS = (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.Tensor.log_softmax)
TOKEN_LOSSES = (F.cross_entropy, F.nll_loss)


class ContextParallelMode(TorchFunctionMode):
    def __init__(self, split: ActiveSplit, group, token_losses: bool):
        super().__init__()
        self.split = split
        self.group = group
        self.token_losses = token_losses

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sdpa_attention(self.split, *args, **kwargs)
        # torch names the function by its module attribute, which a pipelined step may have wrapped
        # (pipeline/summed_losses.py): the wrapper ran already, the loss is torch's
        loss = getattr(func, "__wrapped__", func)
        if self.token_losses and loss in TOKEN_LOSSES:
            return global_token_loss(
                loss, args, kwargs, group=self.group, cp_size=self.split.ring.size,
                local_tokens=self.split.state.local_tokens,
            )
        if func in SOFTMAX_FUNCTIONS:
            self._refuse_score_softmax(args[0] if args else kwargs.get("input"))
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            self._refuse_mask_read(e, args, kwargs)
            raise

    def _refuse_mask_read(self, error: RuntimeError, args, kwargs) -> None:
        """A Hugging Face mask under cp is an empty marker (hf_masks.py): code that combines it with its
        own scores (attention by hand, a sparse-attention indexer) computes over local keys only."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(self.split.masks.derived(t) for t in tensors):
            raise MegatronConfigError(
                f"{self.split.where} reads the attention mask itself ({type(error).__name__}: "
                f"{str(error).splitlines()[0]}): it computes attention scores by hand (eager attention with ALiBi, a "
                "sparse-attention indexer), which cannot see keys on other cp ranks. Only attention through the Hugging "
                "Face attention interface or torch.nn.functional.scaled_dot_product_attention is split; use cp=1."
            ) from error

    def _refuse_score_softmax(self, scores) -> None:
        local = self.split.state.layout.local_len
        if isinstance(scores, torch.Tensor) and scores.dim() >= 3 and scores.shape[-1] == scores.shape[-2] == local:
            raise MegatronConfigError(
                f"{self.split.where} computes a softmax over a ({local} × {local}) local score matrix: attention "
                "written by hand cannot see keys on other cp ranks. Call torch.nn.functional."
                "scaled_dot_product_attention (or use a Hugging Face attn_implementation 'sdpa'/'eager') instead."
            )
