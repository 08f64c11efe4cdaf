"""The user's own ``torch.utils.checkpoint`` on a block where a pipeline stage starts or ends.

A stage feeds its first block the received activation from a forward pre-hook and ends its
forward from a forward hook on its last block. ``checkpoint(block, x)`` in the user's forward
(the memory tutorials' habit) calls ``block.__call__`` inside the checkpoint, so those hooks are
inside too: the replay in backward ran them again, on whatever microbatch the stage held then,
and the gradients were another microbatch's (pp2 losses 22.29 against one device's 22.09); the
reentrant variant runs the forward without grad, so no gradient ever reached the previous stage
(a hang). The strategy's own recompute (``activation_checkpointing="full"``) wraps only the
block's ``forward``, hooks outside, and is exact.

So, while a pipelined step runs, torch's checkpoint of a module that carries a stage's hooks runs
that module plainly (exact; that block's activations are kept), and one warning names the block
and the exact way to recompute under pp. Checkpoints of anything else (the blocks inside a
stage, our own recompute) are torch's, unchanged. torch's ``checkpoint`` looks up its two
implementations in its module on every call, so replacing them there reaches the user's call
however they imported ``checkpoint``.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from megastrategy.pipeline.stage import PipelineStage
from megastrategy.rank_zero import log_on_rank_zero

__all__ = ["UserCheckpoints", "carries_stage_hooks"]

_log = logging.getLogger(__name__)


def carries_stage_hooks(function: Any) -> bool:
    """Whether ``function`` is a module on which a pipeline stage hooked its start or its end."""
    if not isinstance(function, nn.Module):
        return False
    hooks = [*function._forward_pre_hooks.values(), *function._forward_hooks.values()]
    return any(isinstance(getattr(h, "__self__", None), PipelineStage) for h in hooks)


class _PlainRun:
    """Stands in for torch's ``CheckpointFunction`` (the reentrant checkpoint): ``apply`` runs a
    stage's boundary block plainly, anything else through torch's."""

    def __init__(self, original: Any, seen: "UserCheckpoints") -> None:
        self._original, self._seen = original, seen

    def apply(self, function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        if carries_stage_hooks(function):
            self._seen.note(function)
            return function(*args)
        return self._original.apply(function, preserve_rng_state, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


class UserCheckpoints:
    """Runs the user's checkpoints of stage boundary blocks plainly during pipelined steps."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._step_name = ""
        self._names: dict[int, str] = {}

    @contextmanager
    def step(self, step_name: str, module: nn.Module) -> Iterator[None]:
        self._step_name = step_name
        if not self._names:
            self._names = {id(m): n for n, m in module.named_modules()}
        generator = torch_checkpoint._checkpoint_without_reentrant_generator
        reentrant = torch_checkpoint.CheckpointFunction

        def plain_generator(function: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
            if not carries_stage_hooks(function):
                yield from generator(function, *args, **kwargs)
                return
            self.note(function)
            yield  # torch calls function(*args) itself between the two steps of this generator

        torch_checkpoint._checkpoint_without_reentrant_generator = plain_generator
        torch_checkpoint.CheckpointFunction = _PlainRun(reentrant, self)
        try:
            yield
        finally:
            torch_checkpoint._checkpoint_without_reentrant_generator = generator
            torch_checkpoint.CheckpointFunction = reentrant

    def note(self, block: nn.Module) -> None:
        """Warn once per block: its checkpoint runs without recomputation."""
        name = self._names.get(id(block), type(block).__name__)
        if name in self._warned:
            return
        self._warned.add(name)
        log_on_rank_zero(_log, logging.WARNING, (
            f"megastrategy: {self._step_name} runs torch.utils.checkpoint on {name}, where a pipeline stage starts "
            "or ends: replayed in backward, the stage's hooks inside it would run again on another microbatch, so "
            "under pp it runs without recomputation (exact; its activations are kept). To recompute under pp, drop "
            "the call and pass MegatronStrategy(activation_checkpointing='full') (every block, exact), or call "
            "gradient_checkpointing_enable() on a Hugging Face model."))
