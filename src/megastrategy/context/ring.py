"""Asynchronous neighbour exchange around the context-parallel ring.

Each step sends a block to the next rank and receives one from the previous rank while the
caller computes on the block it already holds, so communication overlaps compute. Blocks are
packed into one flat buffer per message; every message kind gets its own tag so that a K/V
rotation and a gradient rotation in flight together can never be matched to each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

TAG_KV = 71
TAG_GRAD_KV = 72


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


@dataclass
class PendingExchange:
    """A send/receive pair in flight; :meth:`wait` returns the received tensors."""

    works: list
    buffer: torch.Tensor
    like: list[torch.Tensor]
    outgoing: torch.Tensor  # kept alive until the send completes

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return unpack(self.buffer, self.like)


@dataclass
class Ring:
    """The ring of one context-parallel group; counts the bytes it sends (for the bench)."""

    group: object
    rank: int
    size: int
    bytes_sent: int = field(default=0)

    @classmethod
    def of(cls, group) -> "Ring":
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def source(self, step: int) -> int:
        """Whose block this rank holds after ``step`` rotations."""
        return (self.rank - step) % self.size

    def start(self, tensors: list[torch.Tensor], tag: int) -> PendingExchange:
        flat = pack([t.detach() for t in tensors]).contiguous()
        incoming = torch.empty_like(flat)
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        ops = [
            dist.P2POp(dist.isend, flat, nxt, self.group, tag),
            dist.P2POp(dist.irecv, incoming, prev, self.group, tag),
        ]
        self.bytes_sent += flat.numel() * flat.element_size()
        works = dist.batch_isend_irecv(ops)
        return PendingExchange(works, incoming, tensors, flat)
