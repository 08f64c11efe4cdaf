"""Activation recompute under context parallelism: a checkpoint's replay runs in the split it was
recorded in.

Why: a checkpointed block keeps only its inputs and runs again in backward, after the forward
context has ended. Replayed there it would attend over local keys only (no ring; the user's
attention implementation back in the configs), number positions locally and take token means per
rank: different gradients, or a crash on the empty Hugging Face mask marker. So while context
parallelism is set up, every ``torch.utils.checkpoint`` call made inside a split forward (the
strategy's ``activation_checkpointing``, Hugging Face's ``gradient_checkpointing_enable()``, the
user's own call, reentrant or not) is given a function that re-enters the same split before it
runs again: ring attention, the function mode (token losses), global positions and the forward's
mask markers. Every cp rank holds the same graph, so all replay the same blocks in the same order
and the ring's messages in the replays pair up.

torch looks its two implementations up in its module on every call, so replacing them there reaches
every caller however it imported ``checkpoint``. They are replaced once for the fit, before a
pipelined step's own replacement (pipeline/user_checkpoint.py), which then calls these.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterator, Optional

import torch.utils.checkpoint as torch_checkpoint

from megastrategy.context.attention_dispatch import ActiveSplit

__all__ = ["ReplayInSplit"]

Current = Callable[[], Optional[ActiveSplit]]
Replay = Callable[[ActiveSplit], ContextManager]


class _Replaying:
    """``function`` run inside ``replay(split)``; with ``originals`` (the reentrant checkpoint's
    arguments, which it detaches before the replay) the forward's mask markers are passed again,
    since a marker is known by identity (hf_masks.py)."""

    def __init__(self, function: Callable, split: ActiveSplit, replay: Replay, originals: Optional[tuple] = None):
        self.function, self.split, self.replay, self.originals = function, split, replay, originals

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.originals is not None:
            args = tuple(o if self.split.masks.rule_of(o) is not None else a for a, o in zip(args, self.originals))
        with self.replay(self.split):
            return self.function(*args, **kwargs)


class _ReentrantCheckpoint:
    """Stands in for torch's ``CheckpointFunction`` (the reentrant checkpoint)."""

    def __init__(self, original: Any, wrap: Callable) -> None:
        self._original, self._wrap = original, wrap

    def apply(self, function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
        return self._original.apply(self._wrap(function, args), preserve_rng_state, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


class ReplayInSplit:
    """Installed while cp is set up (:meth:`install` / :meth:`remove`); ``current`` gives the split
    whose forward runs now (None outside), ``replay(split)`` enters it for a replay."""

    _owners: list["ReplayInSplit"] = []  # every installed one; torch's module is patched while any is
    _saved: Optional[tuple[Any, Any]] = None

    def __init__(self, current: Current, replay: Replay) -> None:
        self.current, self.replay = current, replay

    def install(self) -> None:
        owners = ReplayInSplit._owners
        if not owners:
            ReplayInSplit._saved = (torch_checkpoint._checkpoint_without_reentrant_generator,
                                    torch_checkpoint.CheckpointFunction)
            generator, reentrant = ReplayInSplit._saved

            def replaying_generator(function: Callable, *args: Any, **kwargs: Any) -> Iterator[None]:
                yield from generator(_wrap(function), *args, **kwargs)

            torch_checkpoint._checkpoint_without_reentrant_generator = replaying_generator
            torch_checkpoint.CheckpointFunction = _ReentrantCheckpoint(reentrant, _wrap)
        if self not in owners:
            owners.append(self)

    def remove(self) -> None:
        owners = ReplayInSplit._owners
        if self in owners:
            owners.remove(self)
        if not owners and ReplayInSplit._saved is not None:
            torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction = (
                ReplayInSplit._saved)
            ReplayInSplit._saved = None


def _wrap(function: Callable, originals: Optional[tuple] = None) -> Callable:
    """``function`` bound to the split active now, or unchanged when no split microbatch runs."""
    for owner in ReplayInSplit._owners:
        split = owner.current()
        if split is not None:
            return _Replaying(function, split, owner.replay, originals)
    return function
