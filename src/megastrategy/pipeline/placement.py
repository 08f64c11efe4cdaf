"""Which virtual stage each (pipeline rank, model chunk) runs: the placement, as data.

A schedule, the layer assignment, the executor's choice of neighbours and the simulator all
need the same answer to "which stage is chunk ``c`` of rank ``r``, and who holds stage ``s``?".
Keeping it in one table means a new placement is a new table, not a new special case in each of
them.

* ``ring`` (1F1B and interleaved 1F1B): chunk ``c`` of rank ``r`` is stage ``c * p + r``, so
  the stages run down the ranks ``vp`` times and the last stage is on the last rank.
* ``v`` (ZB-V): chunks alternate direction. Chunk 0 runs down the ranks (stage ``r``), chunk 1
  back up (stage ``2p - 1 - r``), and so on, so the last stage is on rank 0 with the first one:
  the loss is computed where the input enters, and the turn at the bottom (stage ``p - 1`` to
  ``p``) stays on rank ``p - 1`` without a message.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.layer_assignment import check_positive_int

__all__ = ["PLACEMENTS", "StagePlacement"]

#: name -> what it is
PLACEMENTS = {
    "ring": "chunk c of rank r is stage c*p + r (every chunk runs down the ranks)",
    "v": "chunks alternate down and up the ranks: chunk c of rank r is stage c*p + (r if c is even else p-1-r)",
}


@dataclass(frozen=True)
class StagePlacement:
    """``table[rank][chunk]`` is the virtual stage that chunk of that rank runs."""

    name: str
    table: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, name: str, pp_size: int, vp_size: int = 1) -> "StagePlacement":
        """The placement ``name`` (see :data:`PLACEMENTS`) for ``pp_size`` ranks of ``vp_size`` chunks."""
        check_positive_int("pp_size", pp_size)
        check_positive_int("vp_size", vp_size)
        if name not in PLACEMENTS:
            raise MegatronConfigError(f"placement={name!r} is unknown; use one of {sorted(PLACEMENTS)}.")
        zigzag = name == "v"
        table = tuple(
            tuple(c * pp_size + (pp_size - 1 - r if zigzag and c % 2 else r) for c in range(vp_size))
            for r in range(pp_size)
        )
        return cls(name, table)

    @property
    def pp_size(self) -> int:
        return len(self.table)

    @property
    def vp_size(self) -> int:
        return len(self.table[0])

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.vp_size

    def stage(self, rank: int, chunk: int) -> int:
        return self.table[rank][chunk]

    def location(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that runs virtual stage ``stage``."""
        return self._locations[stage]

    def rank_of(self, stage: int) -> int:
        return self.location(stage)[0]

    @property
    def last_rank(self) -> int:
        """The rank that runs the last virtual stage (where the loss is computed)."""
        return self.rank_of(self.num_stages - 1)

    def next_rank(self, rank: int, chunk: int) -> int | None:
        """The rank of the stage after (rank, chunk); ``None`` after the last stage."""
        s = self.stage(rank, chunk)
        return None if s == self.num_stages - 1 else self.rank_of(s + 1)

    def prev_rank(self, rank: int, chunk: int) -> int | None:
        """The rank of the stage before (rank, chunk); ``None`` before the first stage."""
        s = self.stage(rank, chunk)
        return None if s == 0 else self.rank_of(s - 1)

    @cached_property
    def _locations(self) -> dict[int, tuple[int, int]]:
        return {s: (r, c) for r, row in enumerate(self.table) for c, s in enumerate(row)}
