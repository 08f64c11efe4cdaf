"""``overlap_param_gather``: the distributed optimizer's parameter all-gather behind the next forward.

After a ZeRO-1 step each rank has updated only its shard of every bucket; the other ranks'
updates must be all-gathered into the parameters before they are used again. Done synchronously
that is one exposed collective per bucket at the end of every step. Here the gathers are started
asynchronously (in the order the forward will need the buckets: the buffer keeps the last layers
first, so the buckets are started last-to-first) and each module that owns parameters gets a
forward pre-hook that waits for its buckets and copies their gathered values in, just before its
first use. Anything else that reads parameters (the next optimizer step, checkpoints, exports,
evaluation, teardown) calls :meth:`ParamGather.wait_all` first.

The values are exactly those of the synchronous gather (same collective, same bytes), only later.
A parameter read outside its own module's ``forward`` before any forward of that module (e.g. a
weight read directly by another module) would see the previous step's value: such reads must
call ``wait_all`` (the strategy does for every read it makes).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megastrategy.collectives import all_gather_single, try_fused

__all__ = ["ParamGather"]


class ParamGather:
    """Pending all-gathers of updated bucket shards and the forward pre-hooks that finish them.

    Args:
        group: the data-parallel group the shards are gathered over.
        copy_into_params: ``(bucket_index, full)`` copies a gathered bucket into its parameters.
        refused: the shared set of fused collectives the backend turned down.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], copy_into_params: Callable[[int, Tensor], None],
                 refused: set[str]) -> None:
        self.group = group
        self._copy = copy_into_params
        self._refused = refused
        self._pending: dict[int, tuple[Any, Tensor]] = {}  # bucket index -> (work, gathered)
        self._hooks: list[Any] = []
        self.num_waited_in_forward = 0  # buckets finished by a forward pre-hook (cumulative, for tests)

    # ------------------------------------------------------------------ hooks
    def attach(self, module: nn.Module, bucket_of: dict[int, int]) -> None:
        """A pre-hook on every submodule that directly owns parameters of ``bucket_of`` (id -> bucket)."""
        self.detach()
        for m in module.modules():
            wanted = sorted({bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of})
            if wanted:
                self._hooks.append(m.register_forward_pre_hook(self._hook_for(wanted)))

    def _hook_for(self, indices: list[int]) -> Callable[..., None]:
        def wait_before_forward(module: nn.Module, args: Any) -> None:
            if self._pending:
                for i in indices:
                    if i in self._pending:
                        self._finish(i)
                        self.num_waited_in_forward += 1
        return wait_before_forward

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ gathers
    def start(self, index: int, shard: Tensor, numel: int, dp_size: int) -> None:
        """All-gather ``shard`` (this rank's updated part of bucket ``index``) asynchronously."""
        if index in self._pending:
            self._finish(index)  # never two gathers of one bucket in flight
        full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        done, work = try_fused("all_gather", all_gather_single, self._refused, full, shard,
                               group=self.group, async_op=True)
        if not done:
            work = dist.all_gather(list(full.chunk(dp_size)), shard, group=self.group, async_op=True)
        self._pending[index] = (work, full)

    def _finish(self, index: int) -> None:
        work, full = self._pending.pop(index)
        if work is not None:
            work.wait()
        with torch.no_grad():
            self._copy(index, full)

    def wait_all(self) -> None:
        """Finish every pending gather: afterwards every parameter holds the step's update."""
        for index in list(self._pending):
            self._finish(index)

    @property
    def pending(self) -> Iterable[int]:
        return tuple(self._pending)
