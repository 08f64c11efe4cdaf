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

    def __post_init__(self) -> None:
        if self.packed_chunks < 1:
            raise MegatronConfigError(
                f"ShardSpec.packed_chunks={self.packed_chunks}: must be >= 1 (1 = not packed)."
            )
        if self.full_size < 0 or self.padded_size < self.full_size:
            raise MegatronConfigError(
                f"ShardSpec(full_size={self.full_size}, padded_size={self.padded_size}): "
                "padded_size must be >= full_size >= 0."
            )
        if self.full_size % self.packed_chunks or self.padded_size % self.packed_chunks:
            raise MegatronConfigError(
                f"ShardSpec(full_size={self.full_size}, padded_size={self.padded_size}, "
                f"packed_chunks={self.packed_chunks}): both sizes must be divisible by "
                "packed_chunks so that every packed chunk has the same size."
            )

    # -- derived sizes -------------------------------------------------------------
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
        if world < 1 or self.chunk_padded_size % world:
            raise MegatronConfigError(
                f"tensor-parallel size {world} does not divide the padded size "
                f"{self.chunk_padded_size} of each of the {self.packed_chunks} packed chunk(s) "
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
    local_chunk = spec.chunk_padded_size // world
    pad = spec.chunk_padded_size - spec.chunk_full_size
    pieces = []
    for c in range(spec.packed_chunks):
        chunk = full.narrow(dim, c * spec.chunk_full_size, spec.chunk_full_size)
        if pad:
            shape = list(chunk.shape)
            shape[dim] = pad
            chunk = torch.cat([chunk, chunk.new_zeros(shape)], dim=dim)
        pieces.append(chunk.narrow(dim, rank * local_chunk, local_chunk))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def merge_shards(shards: list[Tensor], spec: ShardSpec) -> Tensor:
    """Inverse of :func:`shard_full_tensor`: the user's full tensor (padding stripped)."""
    if not shards:
        raise ValueError("merge_shards needs at least one shard")
    world = len(shards)
    spec._check_world(world)
    dim = _norm_dim(spec.dim, shards[0].dim())
    local_chunk = spec.chunk_padded_size // world
    for i, s in enumerate(shards):
        if s.size(dim) != local_chunk * spec.packed_chunks:
            raise ValueError(
                f"shard {i} has size {s.size(dim)} on dim {dim}; expected "
                f"{local_chunk * spec.packed_chunks} for {world} shards of {spec}"
            )
    chunks = []
    for c in range(spec.packed_chunks):
        padded = torch.cat([s.narrow(dim, c * local_chunk, local_chunk) for s in shards], dim=dim)
        chunks.append(padded.narrow(dim, 0, spec.chunk_full_size))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=dim)
