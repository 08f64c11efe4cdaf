"""Start test processes as forks of a warm interpreter instead of fresh ones.

A launched rank used to spend about 7 CPU-seconds importing torch, Lightning, torchmetrics and
transformers before its first line of work, and the suite launches hundreds of ranks on two
cores: most of a short launch's cost. A ``multiprocessing`` fork server imports those libraries
once per test session (it forks nothing else: no pytest state, no threads, no process group), and
each rank is a fork of it that then runs like ``python script.py args`` would: its own
environment, working directory, ``sys.argv``, ``sys.path[0]`` and ``__main__``, output to a log
file. Our own package is imported by each rank, as before.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import runpy
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional

__all__ = ["warm_context", "ScriptProcess"]

#: imports, once, the third-party libraries every launched script needs (each guarded)
PRELOAD = ["tests.helpers.warm_preload"]


@lru_cache(maxsize=1)
def warm_context() -> mp.context.BaseContext:
    """The fork-server context (started on first use, one per test session)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _redirect_output(log_path: str) -> None:
    """fd 1 and 2 into the log, written through at once (``PYTHONUNBUFFERED``): a rank killed at a
    timeout still shows its last lines."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)


def _run_as_main(script: str, argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the fork: become ``python script argv`` in ``cwd`` with exactly ``env``."""
    _redirect_output(log_path)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = [str(Path(script).parent), *extra]
    sys.argv = [script, *argv]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    runpy.run_path(script, run_name="__main__")


class ScriptProcess:
    """A rank started from the warm fork server, with the part of ``subprocess.Popen``'s interface
    the launchers use (``poll``, ``kill``, ``wait``, ``returncode``)."""

    def __init__(self, script: str, argv: list[str], *, env: dict[str, str], cwd: str, log_path: str) -> None:
        self._process = warm_context().Process(target=_run_as_main, args=(script, argv, env, cwd, log_path))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._process.join(timeout)
        return self._process.exitcode
