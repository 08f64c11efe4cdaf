"""Send what the last stage's model calls returned to every stage of the pipeline, as tensors.

The other stages finish the user's step with these values (:mod:`.model_calls`), so the relay must
rebuild exactly what the model returned: a tensor, a tuple, a dict, a Hugging Face ``ModelOutput``.
It is a :class:`~megastrategy.tree_broadcast.TreeBroadcast` over the pipeline group: one header and
one packed payload per step, the structure pickled only when it changes. Vocabulary-parallel logits
travel as this TP rank's shard and are rebuilt with the receiver's TP group: a pipeline group links
ranks with equal TP rank, which hold the same shard.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from megastrategy.tree_broadcast import TreeBroadcast

__all__ = ["OutputRelay"]

_PLAIN, _VOCAB_PARALLEL = 0, 1


class OutputRelay:
    """Broadcasts a value from the last stage (``src``) to the other ranks of ``group``.

    ``last_bytes`` is what the last :meth:`relay` moved per receiving rank (header and tensors).
    """

    def __init__(self, *, group: Any, src: int, device: Optional[torch.device], tp_group: Any = None) -> None:
        self.tp_group = tp_group
        self._broadcast = TreeBroadcast(group=group, src=src, device=device, encode=_encode, decode=self._decode,
                                        what="the pipeline's relay of what the model returned")

    @property
    def last_bytes(self) -> int:
        return self._broadcast.last_bytes

    def relay(self, value: Any) -> Any:
        """Collective over the group: returns ``src``'s ``value`` (detached) on every rank."""
        return self._broadcast(value)

    def _decode(self, kind: int, local: Tensor, extras: list[int]) -> Tensor:
        if kind == _PLAIN:
            return local
        from megastrategy.layers.vocab_parallel_logits import VocabParallelLogits

        vocab_size, vocab_start, padded = extras
        return VocabParallelLogits.from_local(
            local, vocab_size=vocab_size, vocab_start=vocab_start, padded_vocab_size=padded, group=self.tp_group
        )


def _encode(t: Tensor) -> tuple[int, Tensor, list[int]]:
    """A vocabulary-parallel tensor travels as its own shard; any other as its plain data."""
    from megastrategy.layers.vocab_parallel_logits import VocabParallelLogits, _to_local

    if isinstance(t, VocabParallelLogits):
        return _VOCAB_PARALLEL, _to_local(t), [t.vocab_size, t.vocab_start, t.padded_vocab_size]
    return _PLAIN, t.as_subclass(Tensor) if type(t) is not Tensor else t, []
