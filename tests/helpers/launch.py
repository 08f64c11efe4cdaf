"""Launch a Lightning training script on N real CPU processes, torchrun-style, with a hard timeout.

The ranks are forks of a warm interpreter (:mod:`tests.helpers.warm_start`) that run the script as
``python script args`` would, without importing torch and Lightning again.

Each process gets MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK, which Lightning reads as
an externally launched job (the same path as ``torchrun`` or SLURM). If one process fails, the
others are killed at once; if the whole job exceeds ``timeout`` it is killed and the test fails.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from tests.helpers.dist import free_port
from tests.helpers.warm_start import ScriptProcess

REPO = Path(__file__).resolve().parents[2]


def run_script_to_the_end(
    script: str | Path, nprocs: int, args: list[str], timeout: float = 120, env: Optional[dict] = None
) -> list[tuple[Optional[int], str, float]]:
    """Run every rank until it exits on its own (no killing of peers on a failure).

    Returns ``(exit code, output, seconds until exit)`` per rank; exit code ``None`` means the
    rank was still running at ``timeout`` (then it is killed): a hang.
    """
    port = free_port()
    base_env = dict(os.environ)
    base_env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs), NODE_RANK="0", OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src"), base_env.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
    )
    base_env.update(env or {})
    out = Path(tempfile.mkdtemp(prefix="megastrategy-run-")) / "result.json"
    start = time.monotonic()
    procs, logs, ended = [], [], {}
    for rank in range(nprocs):
        log = tempfile.NamedTemporaryFile(mode="w+", prefix=f"rank{rank}-")
        logs.append(log)
        procs.append(ScriptProcess(str(script), ["--out", str(out), *args], log_path=log.name,
                                   env=dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=str(REPO)))
    while len(ended) < nprocs and time.monotonic() - start < timeout:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.monotonic() - start
        time.sleep(0.1)
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        if p.poll() is None:
            p.kill()
            p.wait()
            code = None
        else:
            code = p.returncode
        log.seek(0)
        results.append((code, log.read(), ended.get(rank, timeout)))
    return results


_RESULTS: dict[tuple, dict[str, Any]] = {}


def run_script(script: str | Path, nprocs: int, args: list[str], timeout: float = 300, env: Optional[dict] = None) -> dict[str, Any]:
    """Run ``python script --out OUT args...`` on ``nprocs`` processes; return the JSON rank 0 wrote to OUT.

    Runs are deterministic, so an identical call (same script, processes, arguments and env) in the
    same test session returns the first result instead of training again: reference runs shared by
    several test files cost once.
    """
    key = (str(script), nprocs, tuple(args), tuple(sorted((env or {}).items())))
    if key not in _RESULTS:
        _RESULTS[key] = _run_script(script, nprocs, args, timeout, env)
    return json.loads(json.dumps(_RESULTS[key]))  # a copy: callers may not alter the cache


def _run_script(script: str | Path, nprocs: int, args: list[str], timeout: float, env: Optional[dict]) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="megastrategy-run-")) / "result.json"
    port = free_port()
    base_env = dict(os.environ)
    base_env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(nprocs),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src"), base_env.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    base_env.update(env or {})
    procs, logs = [], []
    for rank in range(nprocs):
        penv = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
        log = tempfile.NamedTemporaryFile(mode="w+", prefix=f"rank{rank}-")
        logs.append(log)
        procs.append(ScriptProcess(str(script), ["--out", str(out), *args], env=penv, cwd=str(REPO), log_path=log.name))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = f"rank {bad[0]} exited with code {codes[bad[0]]}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout}s (still running: {[r for r, c in enumerate(codes) if c is None]})"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    if failed:
        tails = []
        for rank, log in enumerate(logs):
            log.seek(0)
            text = log.read()
            tails.append(f"----- rank {rank} (last 3000 chars) -----\n{text[-3000:]}")
        raise AssertionError(f"{script} {' '.join(args)} on {nprocs} processes: {failed}\n" + "\n".join(tails))
    return json.loads(out.read_text())


def run_torchrun_nodes(
    script: str | Path, nnodes: int, nproc_per_node: int, args: list[str], timeout: float = 300
) -> tuple[dict[str, Any], list[str]]:
    """One ``torchrun --nnodes N --node_rank i`` per "node", all on 127.0.0.1, as on a real cluster.

    Returns the JSON rank 0 wrote to OUT and each node's output. A node that fails or a job that
    exceeds ``timeout`` fails the test with every node's output; no process outlives the call.
    """
    out = Path(tempfile.mkdtemp(prefix="megastrategy-torchrun-")) / "result.json"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src"), env.get("PYTHONPATH", "")]))
    nodes, logs = [], []
    for node in range(nnodes):
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node}",
               f"--nproc_per_node={nproc_per_node}", "--master_addr=127.0.0.1", f"--master_port={port}",
               str(script), "--out", str(out), *args]
        nodes.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                                      start_new_session=True))  # its own group: its workers go with it
    deadline, failed = time.monotonic() + timeout, None
    try:
        while failed is None and any(p.poll() is None for p in nodes):
            bad = [(i, p.returncode) for i, p in enumerate(nodes) if p.poll() not in (None, 0)]
            failed = f"node {bad[0][0]} exited with code {bad[0][1]}" if bad else None
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout}s"
            time.sleep(0.2)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
    codes = [p.returncode for p in nodes]
    failed = failed or next((f"node {i} exited with code {c}" for i, c in enumerate(codes) if c), None)
    if failed:
        tails = "\n".join(f"----- node {i} (last 3000 chars) -----\n{o[-3000:]}" for i, o in enumerate(outputs))
        raise AssertionError(f"torchrun {script} {' '.join(args)} on {nnodes} nodes: {failed}\n{tails}")
    return json.loads(out.read_text()), outputs
