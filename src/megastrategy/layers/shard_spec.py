"""How a tensor-parallel parameter relates to the user's full (unsharded) tensor.

A sharded parameter carries a :class:`ShardSpec` in its ``megastrategy_shard`` attribute.
:func:`shard_full_tensor` and :func:`merge_shards` are pure functions (no communication)
that convert between the user's full tensor and the per-rank shards; checkpointing and
the layers themselves use them, so the layout is defined in exactly one place.

Layout rules
------------
* The split dimension ``dim`` of the full tensor has ``full_size`` entries. It is
  zero-padded at its end to ``padded_size`` (a multiple of the tensor-parallel size),
  then cut into ``world`` equal contiguous pieces; rank ``r`` owns piece ``r``.
* With ``packed_chunks = c > 1`` the dimension is a concatenation ``[c0 | c1 | ...]`` of
  ``c`` equal chunks (e.g. a fused QKV projection). Each chunk is padded and split on
  its own and rank ``r`` holds ``[c0_r | c1_r | ...]``.
* With ``packed_sections = (s0, s1, ...)`` the packed sections have explicit, possibly unequal
  sizes (a grouped-query attention's ``[q | k | v]``: ``n_head`` query heads, then fewer key
  and value heads). Each section is split on its own, like an equal chunk, but is never padded:
  every section must be divisible by the tensor-parallel size. :meth:`ShardSpec.sections` is the
  one description of both cases that the functions here and the checkpoint layout read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megastrategy.errors import MegatronConfigError

SHARD_ATTR = "megastrategy_shard"

__all__ = [
    "SHARD_ATTR",
    "ShardSpec",
    "set_shard_spec",
    "get_shard_spec",
    "shard_full_tensor",
    "merge_shards",
    "padded_size_for",
]


@dataclass(frozen=True)
class ShardSpec:
    dim: int  # dimension of the user's full tensor that is split over TP
    full_size: int  # size of that dim in the user's tensor (e.g. real vocab 30522)
    padded_size: int  # after padding to a multiple of tp (== full_size without padding)
    packed_chunks: int = 1  # packed projections (QKV): dim is [c0|c1|c2]; each chunk split separately
    packed_sections: tuple[int, ...] = ()  # unequal packed projections (GQA qkv): their full sizes

    def __post_init__(self) -> None:
        if self.packed_sections:
            self._check_sections()
        if self.packed_chunks < 1:
            raise MegatronConfigError(
                f"ShardSpec.packed_chunks={self.packed_chunks}: must be >= 1 (1 = not packed)."
            )
        if self.full_size < 0 or self.padded_size < self.full_size:
            raise MegatronConfigError(
                f"ShardSpec(full_size={self.full_size}, padded_size={self.padded_size}): "
                "padded_size must be >= full_size >= 0."
            )
        if not self.packed_sections and (self.full_size % self.packed_chunks or self.padded_size % self.packed_chunks):
            raise MegatronConfigError(
                f"ShardSpec(full_size={self.full_size}, padded_size={self.padded_size}, "
                f"packed_chunks={self.packed_chunks}): both sizes must be divisible by "
                "packed_chunks so that every packed chunk has the same size."
            )

    def _check_sections(self) -> None:
        sections = self.packed_sections
        if (self.packed_chunks != len(sections) or any(int(x) < 1 for x in sections)
                or sum(sections) != self.full_size or self.padded_size != self.full_size):
            raise MegatronConfigError(
                f"ShardSpec(full_size={self.full_size}, padded_size={self.padded_size}, packed_chunks="
                f"{self.packed_chunks}, packed_sections={sections}): packed sections must be positive, "
                "one per packed chunk, sum to full_size, and are not padded (padded_size == full_size)."
            )

    # -- derived sizes -------------------------------------------------------------
    def sections(self) -> list[tuple[int, int, int]]:
        """``(start, full size, padded size)`` in the full tensor of each packed section
        (equal chunks, or the explicit ``packed_sections``, which are never padded)."""
        if self.packed_sections:
            starts = [sum(self.packed_sections[:i]) for i in range(len(self.packed_sections))]
            return [(a, n, n) for a, n in zip(starts, self.packed_sections)]
        return [(c * self.chunk_full_size, self.chunk_full_size, self.chunk_padded_size)
                for c in range(self.packed_chunks)]

    @property
    def chunk_full_size(self) -> int:
        return self.full_size // self.packed_chunks

    @property
    def chunk_padded_size(self) -> int:
        return self.padded_size // self.packed_chunks

    def local_size(self, world: int) -> int:
        """Size of ``dim`` in one rank's shard."""
        self._check_world(world)
        return self.padded_size // world

    def _check_world(self, world: int) -> None:
        bad = [padded for _, _, padded in self.sections() if world < 1 or padded % world]
        if bad and self.packed_sections:
            raise MegatronConfigError(
                f"tensor-parallel size {world} does not divide the size {bad[0]} of a packed section "
                f"(ShardSpec dim={self.dim}, packed_sections={self.packed_sections}); sections are not "
                "padded: pick a tensor-parallel size that divides every section."
            )
        if bad:
            raise MegatronConfigError(
                f"tensor-parallel size {world} does not divide the padded size "
                f"{bad[0]} of each of the {self.packed_chunks} packed chunk(s) "
                f"(ShardSpec dim={self.dim}, full_size={self.full_size}, "
                f"padded_size={self.padded_size}); pad the dimension to a multiple of {world} "
                "or pick a tensor-parallel size that divides it."
            )


def padded_size_for(full_size: int, world: int, packed_chunks: int = 1) -> int:
    """Smallest size >= ``full_size`` whose every packed chunk is a multiple of ``world``."""
    if full_size % packed_chunks:
        raise MegatronConfigError(
            f"size {full_size} is not divisible by packed_chunks={packed_chunks}."
        )
    chunk = full_size // packed_chunks
    return -(-chunk // world) * world * packed_chunks


def set_shard_spec(param: Tensor, spec: ShardSpec) -> None:
    """Record on ``param`` how it is split over tensor parallelism."""
    if not isinstance(spec, ShardSpec):
        raise TypeError(f"expected a ShardSpec, got {type(spec).__name__}")
    setattr(param, SHARD_ATTR, spec)


def get_shard_spec(param: Tensor) -> ShardSpec | None:
    """The parameter's ShardSpec, or None when it is replicated over tensor parallelism."""
    return getattr(param, SHARD_ATTR, None)


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"ShardSpec dim {dim} out of range for a tensor with {ndim} dims")
    return dim % ndim


def shard_full_tensor(full: Tensor, spec: ShardSpec, rank: int, world: int) -> Tensor:
    """The piece of the user's ``full`` tensor that rank ``rank`` of ``world`` holds.

    Pure slicing plus zero padding; the result may share storage with ``full`` (clone it
    to own it). Raises when ``full`` does not have ``spec.full_size`` entries on ``dim``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    spec._check_world(world)
    dim = _norm_dim(spec.dim, full.dim())
    if full.size(dim) != spec.full_size:
        raise ValueError(
            f"tensor has size {full.size(dim)} on dim {dim}, but its ShardSpec says "
            f"full_size={spec.full_size}"
        )
    pieces = []
    for start, size, padded in spec.sections():
        chunk = full.narrow(dim, start, size)
        if padded > size:
            shape = list(chunk.shape)
            shape[dim] = padded - size
            chunk = torch.cat([chunk, chunk.new_zeros(shape)], dim=dim)
        local = padded // world
        pieces.append(chunk.narrow(dim, rank * local, local))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def merge_shards(shards: list[Tensor], spec: ShardSpec) -> Tensor:
    """Inverse of :func:`shard_full_tensor`: the user's full tensor (padding stripped)."""
    if not shards:
        raise ValueError("merge_shards needs at least one shard")
    world = len(shards)
    spec._check_world(world)
    dim = _norm_dim(spec.dim, shards[0].dim())
    expected = spec.padded_size // world
    for i, s in enumerate(shards):
        if s.size(dim) != expected:
            raise ValueError(
                f"shard {i} has size {s.size(dim)} on dim {dim}; expected "
                f"{expected} for {world} shards of {spec}"
            )
    chunks, at = [], 0
    for _, size, padded in spec.sections():
        local = padded // world
        whole = torch.cat([s.narrow(dim, at, local) for s in shards], dim=dim)
        chunks.append(whole.narrow(dim, 0, size))
        at += local
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=dim)
