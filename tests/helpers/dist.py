"""Run a function on N real CPU processes (gloo over 127.0.0.1), with a hard timeout.

A hang or a crash on any rank fails the calling test with that rank's traceback;
no process outlives the test.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable


from megastrategy.ports import free_port  # noqa: F401  (re-exported for the launchers)
from tests.helpers.warm_start import warm_context

DEFAULT_TIMEOUT_S = 120




def _worker(fn, rank, world_size, port, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # The report must be in the pipe before teardown: tearing down gloo while a peer is gone
        # can kill this process, and a loaded machine may not have flushed the queue by then.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the values by rank.

    ``fn`` must be importable (defined at module level). The default process group is
    initialized (gloo) before ``fn`` runs and destroyed after.
    """
    ctx = warm_context()  # forks of a server that imported torch once, not fresh interpreters
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import queue
    import time

    deadline = time.monotonic() + timeout
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(collected) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed test timed out after {timeout}s; ranks that finished: {sorted(collected)}"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not errors:
                    # a rank died without reporting (segfault, SIGKILL): no point waiting long
                    time.sleep(2.0)
                    if results.empty():
                        raise RuntimeError(f"ranks {dead} exited with codes {[procs[i].exitcode for i in dead]}")
                continue
            if status == "ok":
                collected[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # one failure is enough; the others may be stuck in a collective
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [collected[r] for r in range(world_size)]
