"""``MegatronStrategy(async_checkpoint=True)``: checkpoints written by a background thread.

The training loop stalls only for what must happen in step: the ``<name>.tmp`` directory and a
copy of this rank's tensors on the CPU (:func:`~.dcp_io.snapshot`). DCP then writes the copy
from a thread over a gloo group of its own (a collective in flight on the training group would
interleave with the training's), and the coordinator renames ``<name>.tmp`` to ``<name>`` once
DCP has written ``.metadata``, i.e. after every rank's data: as with synchronous saves, a rank
killed mid-save leaves the previous checkpoint loadable and nothing half-written under a final
name. Saves run one at a time in call order; the next save, a load and the end of the run wait
for the one in flight and raise its error, if any.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from megastrategy.checkpoint.dcp_io import PathLike, default_barrier, prepare_tmp_dir, publish, snapshot, write_dcp

__all__ = ["AsyncCheckpointWriter"]


class AsyncCheckpointWriter:
    """Writes one checkpoint at a time in the background (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: Optional[Future] = None
        self._group: Any = None

    def submit(self, path: PathLike, objects: dict[str, Any], *, is_coordinator: bool,
               barrier: Callable[[], None] = default_barrier) -> None:
        """Collective: start writing ``objects`` to ``path``; returns once they are copied."""
        self.wait()
        tmp = prepare_tmp_dir(path, is_coordinator=is_coordinator, barrier=barrier)
        copied = snapshot(objects)
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # collective: every rank saves together
        self._pending = Future()
        # A daemon thread: a process that fails while a save is in flight must still be able to exit.
        threading.Thread(target=self._write, args=(self._pending, Path(path), tmp, copied, is_coordinator),
                         name="megastrategy-checkpoint", daemon=True).start()

    def _write(self, done: Future, final: Path, tmp: Path, objects: dict[str, Any], is_coordinator: bool) -> None:
        try:
            write_dcp(tmp, objects, process_group=self._group)
            if is_coordinator:
                publish(final)
            if self._group is not None:  # every rank's save ends when the checkpoint has its final name
                dist.barrier(group=self._group)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(err)
        else:
            done.set_result(None)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the save in flight is on disk; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def abandon(self) -> None:
        """Forget the save in flight without waiting (after a failure; it may never finish)."""
        self._pending = None

    def close(self) -> None:
        self.wait()
