"""Send what the last stage's model calls returned to every stage of the pipeline, as tensors.

The other stages finish the user's step with these values (:mod:`.model_calls`), so the relay must
rebuild exactly what the model returned: a tensor, a tuple, a dict, a Hugging Face ``ModelOutput``.
Each relay is one small int64 header (its length first), then one broadcast per tensor over the
pipeline group; the structure around the tensors (containers, non-tensor values) is pickled only
when it differs from the previous relay's, which in a training loop is once. Vocabulary-parallel
logits travel as this TP rank's shard and are rebuilt with the receiver's TP group: a pipeline
group links ranks with equal TP rank, which hold the same shard.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megastrategy.batch_tree import flatten_batch, unflatten_batch
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.p2p import _DTYPE_CODES, _DTYPES

__all__ = ["OutputRelay"]

_PLAIN, _VOCAB_PARALLEL = 0, 1


class _TensorSlot:
    """Where a tensor sits among the leaves of a relayed structure."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TensorSlot)

    def __hash__(self) -> int:
        return 0


class OutputRelay:
    """Broadcasts a value from the last stage (``src``) to the other ranks of ``group``.

    ``last_bytes`` is what the last :meth:`relay` moved per receiving rank (header and tensors).
    """

    def __init__(self, *, group: Any, src: int, device: Optional[torch.device], tp_group: Any = None) -> None:
        self.group, self.src, self.tp_group = group, src, tp_group
        self.device = device if device is not None else torch.device("cpu")
        self._structure: Any = None  # the last relayed structure, the same on every rank
        self.last_bytes = 0

    def relay(self, value: Any) -> Any:
        """Collective over the group: returns ``src``'s ``value`` (detached) on every rank."""
        if dist.get_rank() == self.src:
            return self._send(value)
        return self._receive()

    def _send(self, value: Any) -> Any:
        leaves, spec = flatten_batch(value)
        tensors = [leaf.detach() for leaf in leaves if isinstance(leaf, Tensor)]
        structure = (spec, tuple(_TensorSlot() if isinstance(leaf, Tensor) else leaf for leaf in leaves))
        new = not _same(structure, self._structure)
        header = [int(new), len(tensors)] + [n for t in tensors for n in _describe(t)]
        self._broadcast_header(header)
        if new:
            self._structure = structure
            dist.broadcast_object_list([structure], src=self.src, group=self.group)
        for t in tensors:
            dist.broadcast(_local(t).contiguous(), src=self.src, group=self.group)
        self.last_bytes = 8 * (len(header) + 1) + sum(_local(t).numel() * t.element_size() for t in tensors)
        it = iter(tensors)
        return unflatten_batch([next(it) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)

    def _receive(self) -> Any:
        header = self._broadcast_header(None)
        new, count, rest = header[0], header[1], header[2:]
        if new:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            self._structure = box[0]
        tensors = []
        for _ in range(count):
            tensor, rest = self._receive_tensor(rest)
            tensors.append(tensor)
        self.last_bytes = 8 * (len(header) + 1) + sum(_local(t).numel() * t.element_size() for t in tensors)
        spec, leaves = self._structure
        it = iter(tensors)
        return unflatten_batch([next(it) if isinstance(leaf, _TensorSlot) else leaf for leaf in leaves], spec)

    def _receive_tensor(self, header: list[int]) -> tuple[Tensor, list[int]]:
        kind, dtype, ndim = header[:3]
        shape, header = header[3 : 3 + ndim], header[3 + ndim :]
        buffer = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        dist.broadcast(buffer, src=self.src, group=self.group)
        if kind == _PLAIN:
            return buffer, header
        from megastrategy.layers.vocab_parallel_logits import VocabParallelLogits

        vocab_size, vocab_start, padded = header[:3]
        logits = VocabParallelLogits.from_local(
            buffer, vocab_size=vocab_size, vocab_start=vocab_start, padded_vocab_size=padded, group=self.tp_group
        )
        return logits, header[3:]

    def _broadcast_header(self, header: Optional[list[int]]) -> list[int]:
        length = torch.tensor([len(header) if header is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=self.src, group=self.group)
        values = torch.tensor(header, dtype=torch.int64, device=self.device) if header is not None else None
        if values is None:
            values = torch.empty(int(length), dtype=torch.int64, device=self.device)
        dist.broadcast(values, src=self.src, group=self.group)
        return values.tolist()


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality (arrays): treat as changed
        return False


def _vocab_parallel(t: Tensor) -> bool:
    from megastrategy.layers.vocab_parallel_logits import VocabParallelLogits

    return isinstance(t, VocabParallelLogits)


def _local(t: Tensor) -> Tensor:
    """The bytes that travel: a vocabulary-parallel tensor's own shard, any tensor's plain data."""
    if _vocab_parallel(t):
        from megastrategy.layers.vocab_parallel_logits import _to_local

        return _to_local(t)
    return t.as_subclass(Tensor) if type(t) is not Tensor else t


def _describe(t: Tensor) -> list[int]:
    if t.dtype not in _DTYPE_CODES:
        raise MegatronConfigError(f"the model returned a {t.dtype} tensor, which the pipeline cannot relay.")
    local = _local(t)
    out = [_VOCAB_PARALLEL if _vocab_parallel(t) else _PLAIN, _DTYPE_CODES[t.dtype], local.dim(), *local.shape]
    if _vocab_parallel(t):
        out += [t.vocab_size, t.vocab_start, t.padded_vocab_size]
    return out
