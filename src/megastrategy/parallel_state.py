"""Process-group layout: which global ranks share a tensor-, pipeline-, data-, context- or
expert-parallel group.

Megatron's construction: lay the world out as a grid whose axes are named by ``order``
(first axis varies fastest), then a group for a set of axes is the set of ranks that differ
only along those axes ("masked-orthogonal" groups). Two grids cover the same world: the dense
one ``(tp, cp, dp, pp)`` for attention and MLPs, and the expert one ``(etp, ep, edp, pp)`` for
MoE layers ("MoE parallel folding"), so expert parallelism is laid out independently of the
attention layout.

Everything here except :class:`ParallelState` is pure arithmetic and needs no processes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megastrategy.divisors import divisors
from megastrategy.errors import MegatronConfigError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMS = ("tp", "cp", "ep", "dp", "pp")


class RankGenerator:
    """Enumerates rank groups of a grid ``tp × cp × ep × dp × pp`` laid out in ``order``."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str = DEFAULT_ORDER):
        self.sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        for name, size in self.sizes.items():
            if not isinstance(size, int) or size < 1:
                raise MegatronConfigError(f"{name}={size!r} must be a positive integer.")
        self.order = [d.strip() for d in order.lower().split("-")]
        unknown = [d for d in self.order if d not in _DIMS]
        if unknown or len(set(self.order)) != len(self.order):
            raise MegatronConfigError(
                f"order={order!r}: each dimension must be one of {list(_DIMS)} and appear once; "
                f"for example {DEFAULT_ORDER!r}."
            )
        missing = [d for d, s in self.sizes.items() if s > 1 and d not in self.order]
        if missing:
            raise MegatronConfigError(
                f"order={order!r} leaves out {missing}, whose size is > 1 "
                f"({', '.join(f'{d}={self.sizes[d]}' for d in missing)}); every dimension larger than 1 "
                f"must be placed in the order, e.g. {DEFAULT_ORDER!r}."
            )
        if ep > 1 and cp > 1:
            raise MegatronConfigError(
                f"ep={ep} with cp={cp} in one rank grid: expert and context parallelism cannot share a "
                "grid; the dense grid takes cp (with ep=1) and the expert grid takes ep (with cp=1)."
            )
        # Dimensions of size 1 may be absent from the order; they add no axis.
        self.axes = [d for d in self.order if d in self.sizes]
        self.world_size = math.prod(self.sizes.values())

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for d in self.axes:
            strides[d] = stride
            stride *= self.sizes[d]
        return strides

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every dimension."""
        coords = {d: 0 for d in _DIMS}
        for d, stride in self._strides().items():
            coords[d] = (rank // stride) % self.sizes[d]
        return coords

    def get_ranks(self, token: str) -> list[list[int]]:
        """Groups of ranks that differ only along the dimensions named in ``token`` (e.g. ``"tp-pp"``).

        Groups are listed with the first remaining axis of ``order`` varying fastest, and ranks
        inside a group with the first named axis varying fastest, so every rank computes the same
        list in the same order.
        """
        names = [t.strip() for t in token.lower().split("-") if t.strip()]
        unknown = [n for n in names if n not in _DIMS]
        if unknown or not names:
            raise MegatronConfigError(
                f"token={token!r}: name one or more of {list(_DIMS)} joined by '-', e.g. 'tp' or 'tp-pp'."
            )
        strides = self._strides()
        inside = [d for d in self.axes if d in names]
        outside = [d for d in self.axes if d not in names]

        def enumerate_axes(axes: list[str]) -> list[int]:
            offsets = [0]
            for d in axes:  # first axis fastest: extend by the later axes as outer loops
                offsets = [o + i * strides[d] for i in range(self.sizes[d]) for o in offsets]
            return offsets

        return [[base + off for off in enumerate_axes(inside)] for base in enumerate_axes(outside)]


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of every parallel dimension for one world; validated on construction."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vp: Optional[int] = None
    order: str = DEFAULT_ORDER
    dp: int = field(init=False)
    edp: int = field(init=False)

    def summary(self) -> str:
        """One line for the log: how the world is divided."""
        return (f"megastrategy: {self.world_size} processes as tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp} "
                f"ep={self.ep} (order {self.order})")

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MegatronConfigError(f"{name}={value!r} must be a positive integer.")
        dense = self.tp * self.pp * self.cp
        if self.world_size % dense:
            raise MegatronConfigError(
                f"world size {self.world_size} is not divisible by tp·pp·cp = {self.tp}·{self.pp}·{self.cp} = {dense}; "
                f"the data-parallel size is world/(tp·pp·cp). Use a world size that is a multiple of {dense}, "
                f"or tp·pp·cp among the divisors of {self.world_size}: {divisors(self.world_size)}."
            )
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise MegatronConfigError(
                f"world size {self.world_size} is not divisible by etp·ep·pp = {self.etp}·{self.ep}·{self.pp} = {expert}; "
                f"the expert-data-parallel size is world/(etp·ep·pp). Choose etp·ep·pp among the divisors of "
                f"{self.world_size}: {divisors(self.world_size)}."
            )
        if self.vp is not None:
            if not isinstance(self.vp, int) or self.vp < 1:
                raise MegatronConfigError(f"vp={self.vp!r} must be a positive integer or None.")
            if self.vp > 1 and self.pp == 1:
                raise MegatronConfigError(
                    f"vp={self.vp} needs pipeline parallelism: virtual stages interleave chunks across pp ranks, "
                    "but pp=1. Set pp>1 (e.g. pp=2, vp=2) or leave vp=None."
                )
        object.__setattr__(self, "dp", self.world_size // dense)
        object.__setattr__(self, "edp", self.world_size // expert)
        # Build both generators now so that order problems surface before any process group exists.
        self.dense_generator()
        self.expert_generator()

    def dense_generator(self) -> RankGenerator:
        return RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=self.cp, order=self.order)

    def expert_generator(self) -> RankGenerator:
        return RankGenerator(tp=self.etp, ep=self.ep, dp=self.edp, pp=self.pp, cp=1, order=self.order)


class ParallelState:
    """The process groups of one rank, created in the same order on every rank.

    Owned by the strategy and passed to whatever needs a group; there is no module-level state.
    Must be constructed collectively (every rank of the default group calls it).
    """

    def __init__(
        self,
        layout: ParallelLayout,
        rank: int,
        *,
        backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self._created: list = []
        dense, expert = layout.dense_generator(), layout.expert_generator()
        self.coords = dense.coordinates(rank)
        self.expert_coords = expert.coordinates(rank)

        def make(groups: list[list[int]]):
            mine = (None, [])  # embedding groups leave out the middle stages
            for ranks in groups:  # every rank creates every group, in one global order
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                self._created.append(group)
                if rank in ranks:
                    mine = (group, ranks)
            return mine

        self.tp_group, self.tp_ranks = make(dense.get_ranks("tp"))
        self.pp_group, self.pp_ranks = make(dense.get_ranks("pp"))
        self.dp_group, self.dp_ranks = make(dense.get_ranks("dp"))
        self.cp_group, self.cp_ranks = make(dense.get_ranks("cp"))
        self.dp_cp_group, self.dp_cp_ranks = make(dense.get_ranks("dp-cp"))
        self.mp_group, self.mp_ranks = make(dense.get_ranks("tp-pp"))
        self.tp_dp_group, self.tp_dp_ranks = make(dense.get_ranks("tp-dp"))
        # every rank of one model replica (all but dp): they must see the same batch
        self.replica_group, self.replica_ranks = make(dense.get_ranks("tp-cp-pp"))
        pp_groups = dense.get_ranks("pp")
        self.embedding_group, self.embedding_ranks = make(
            [sorted({g[0], g[-1]}) for g in pp_groups]
        )
        self.position_embedding_group, self.position_embedding_ranks = make([[g[0]] for g in pp_groups])
        self.ep_group, self.ep_ranks = make(expert.get_ranks("ep"))
        self.expert_tp_group, self.expert_tp_ranks = make(expert.get_ranks("tp"))
        self.expert_dp_group, self.expert_dp_ranks = make(expert.get_ranks("dp"))

    # sizes and ranks -----------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def ep_rank(self) -> int:
        return self.expert_coords["ep"]

    @property
    def expert_tp_rank(self) -> int:
        return self.expert_coords["tp"]

    @property
    def expert_dp_rank(self) -> int:
        return self.expert_coords["dp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as the interleaved schedule needs)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_stage_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    def describe(self) -> str:
        c = self.coords
        return (
            f"rank {self.rank}: tp {c['tp']}/{self.tp_size} pp {c['pp']}/{self.pp_size} "
            f"dp {c['dp']}/{self.dp_size} cp {c['cp']}/{self.cp_size} ep {self.ep_rank}/{self.ep_size}"
        )

    def destroy(self) -> None:
        for group in self._created:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass  # already gone with the default group
        self._created.clear()
