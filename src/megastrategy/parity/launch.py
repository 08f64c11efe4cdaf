"""Start N local ranks of one command torchrun-style, with a hard timeout.

Each rank gets ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``, which
Lightning reads as an externally launched job. When one rank fails the others are stopped at once,
and a job that outlives ``timeout`` is stopped: a hang is an error, never a wait.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from megastrategy.ports import free_port

__all__ = ["RanksFailed", "launch_ranks"]


class RanksFailed(RuntimeError):
    """A rank exited with an error, or the job ran past its timeout; carries every rank's output tail."""




def launch_ranks(argv: Sequence[str], nprocs: int, *, timeout: float, env: Optional[dict] = None) -> None:
    """Run ``python argv...`` on ``nprocs`` local ranks until all succeed; raise :class:`RanksFailed` otherwise."""
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs),
                NODE_RANK="0", PYTHONUNBUFFERED="1", **(env or {}))
    base.setdefault("OMP_NUM_THREADS", "1")
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(nprocs)]
    procs = [subprocess.Popen([sys.executable, *argv], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(nprocs)]
    failure = _wait(procs, timeout)
    if failure:
        raise RanksFailed(f"{' '.join(argv)} on {nprocs} process(es): {failure}\n" + _tails(logs))


def _wait(procs: list[subprocess.Popen], timeout: float) -> Optional[str]:
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                return f"rank {bad[0]} exited with code {codes[bad[0]]}"
            if all(c == 0 for c in codes):
                return None
            if time.monotonic() > deadline:
                return f"timed out after {timeout:.0f}s"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _tails(logs: list, chars: int = 3000) -> str:
    parts = []
    for rank, log in enumerate(logs):
        log.seek(0)
        parts.append(f"----- rank {rank} (last {chars} characters) -----\n{log.read()[-chars:]}")
    return "\n".join(parts)
