"""Which global token positions each context-parallel rank holds.

Causal attention gives late tokens more work than early ones, so a contiguous split would
leave the last rank with most of the attention FLOPs. The balanced layout cuts the sequence
into ``2·cp`` equal chunks and gives rank ``r`` chunks ``r`` and ``2·cp−1−r``: one early and one
late chunk each, so every rank does the same causal work. Bidirectional attention has no such
imbalance and uses one contiguous chunk per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megastrategy.errors import MegatronConfigError

LAYOUTS = ("balanced", "contiguous")


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive global positions ``[start, start + length)``; ``local_start`` is
    where it begins in the rank's local sequence."""

    start: int
    length: int
    local_start: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class SequenceLayout:
    """The split of one sequence of ``seq_len`` tokens over ``cp_size`` ranks."""

    kind: str
    seq_len: int
    cp_size: int

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise MegatronConfigError(f"layout={self.kind!r}: must be one of {LAYOUTS}.")
        parts = self.chunks_per_rank * self.cp_size
        if self.seq_len % parts:
            multiple = parts
            padded = -(-self.seq_len // multiple) * multiple
            raise MegatronConfigError(
                f"sequence length {self.seq_len} is not divisible by {parts} "
                f"({'2·cp' if self.kind == 'balanced' else 'cp'} for the {self.kind} layout at cp={self.cp_size}): "
                f"every rank must hold the same number of tokens. Pad the sequences to a multiple of {multiple} "
                f"(e.g. {padded}) in the dataloader."
            )

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.kind == "balanced" and self.cp_size > 1 else 1

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_size

    def chunks(self, rank: int) -> list[Chunk]:
        """The global runs rank ``rank`` holds, in local order."""
        size = self.seq_len // (self.chunks_per_rank * self.cp_size)
        if self.chunks_per_rank == 1:
            return [Chunk(rank * size, size, 0)]
        last = 2 * self.cp_size - 1 - rank
        return [Chunk(rank * size, size, 0), Chunk(last * size, size, size)]

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Global positions of rank ``rank``'s local tokens, shape ``(local_len,)``."""
        return torch.cat([torch.arange(c.start, c.stop, device=device) for c in self.chunks(rank)])

    def split(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s part of a tensor whose dimension ``dim`` is the whole sequence."""
        parts = [tensor.narrow(dim, c.start, c.length) for c in self.chunks(rank)]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=dim)

    def merge(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`split`: one local tensor per rank back to global order."""
        pieces = []
        for rank, part in enumerate(parts):
            for chunk in self.chunks(rank):
                pieces.append((chunk.start, part.narrow(dim, chunk.local_start, chunk.length)))
        return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim=dim)
