"""Helpers shared by the benchmark scripts: machine info, process launchers, number formatting,
result tables and reports.

Importing it sets ``OMP_NUM_THREADS=1`` (before torch is imported, here and in every child)
and puts ``src/`` and ``examples/`` on ``sys.path``, so a script imports it first.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every child
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
for _p in (REPO / "src", REPO / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from megastrategy.ports import free_port  # noqa: E402  (src/ is on sys.path above)


def machine_info() -> dict[str, Any]:
    """Date, CPU and software versions, for the header of every result."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        import lightning

        lightning_version = lightning.__version__
    except ImportError:  # pragma: no cover
        lightning_version = "n/a"
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu_model": cpu,
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning_version,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
    }


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"date: {info['date']} | machine: {info['cpu_cores']} cores ({info['usable_cores']} usable), "
        f"{info['cpu_model']}, {info['memory_gib']} GiB | torch {info['torch']}, lightning "
        f"{info['lightning']}, python {info['python']}, OMP_NUM_THREADS={info['omp_num_threads']}"
    )




def _spawn_entry(fn, rank, world, port, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch as _torch
    import torch.distributed as dist

    _torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes (gloo initialized);
    return the values by rank. Any failure or the timeout kills every process."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawn_entry, args=(fn, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    error = None
    try:
        while len(values) < world and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"timed out after {timeout:.0f}s (finished ranks: {sorted(values)})"
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)
                    if results.empty():
                        error = f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}"
                continue
            if ok:
                values[rank] = value
            else:
                error = f"rank {rank} failed:\n{value}"
    finally:
        for p in procs:
            p.join(timeout=5 if error is None else 0)
            if p.is_alive():
                p.kill()
                p.join()
    if error is not None:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} on {world} processes: {error}")
    return [values[r] for r in range(world)]


def launch_script(script: Path, nprocs: int, argv: list[str], timeout: float, *, torchrun_env: bool = True) -> list[str]:
    """Start ``python script argv`` on ``nprocs`` processes (torchrun-style environment unless
    ``torchrun_env`` is False); return each rank's output. Kills all on failure or timeout."""
    env = dict(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]))
    if torchrun_env:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs), NODE_RANK="0")
    procs, logs = [], []
    for rank in range(nprocs):
        penv = dict(env)
        if torchrun_env:
            penv.update(RANK=str(rank), LOCAL_RANK=str(rank))
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *argv], env=penv, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=str(REPO)))
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failure = f"rank {bad[0]} exited with code {codes[bad[0]]}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout:.0f}s"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if failure:
        tails = "\n".join(f"----- rank {r} -----\n{o[-4000:]}" for r, o in enumerate(outputs))
        raise RuntimeError(f"{script.name} {' '.join(argv)[:200]} on {nprocs} processes: {failure}\n{tails}")
    return outputs


def fmt_num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:
            return "nan"
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) < 1e-3:
            return f"{x:.2e}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{max(digits - 1, 1)}f}".rstrip("0").rstrip(".")
    return str(x)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt_num(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sep = "-+-".join("-" * w for w in widths)
    lines = [" | ".join(c.ljust(w) for c, w in zip(cells[0], widths)), sep]
    lines += [" | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells[1:]]
    return "\n".join(lines)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def esc(c: Any) -> str:
        return (c if isinstance(c, str) else fmt_num(c)).replace("|", "\\|")

    out = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


class Report:
    """Collects titled tables and notes; prints them as they come and saves JSON + markdown."""

    def __init__(self, name: str, title: str, info: dict[str, Any], config: dict[str, Any]):
        self.name, self.title, self.info, self.config = name, title, info, config
        self.sections: list[dict[str, Any]] = []
        print(f"# {title}\n{machine_line(info)}\n", flush=True)

    def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = (),
              raw: Any = None) -> None:
        self.sections.append({"title": title, "headers": list(headers), "rows": [list(r) for r in rows],
                              "notes": list(notes), "raw": raw})
        print(f"## {title}\n{text_table(headers, rows)}", flush=True)
        for n in notes:
            print(f"  * {n}", flush=True)
        print(flush=True)

    def save(self, out_dir: Path) -> tuple[Path, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        js = out_dir / f"{self.name}.json"
        md = out_dir / f"{self.name}.md"
        js.write_text(json.dumps({"title": self.title, "machine": self.info, "config": self.config,
                                  "sections": self.sections}, indent=1, default=str))
        parts = [f"# {self.title}", "", machine_line(self.info), "",
                 "config: `" + json.dumps(self.config, default=str) + "`", ""]
        for s in self.sections:
            parts += [f"## {s['title']}", "", md_table(s["headers"], s["rows"]), ""]
            parts += [f"* {n}" for n in s["notes"]]
            if s["notes"]:
                parts.append("")
        md.write_text("\n".join(parts))
        return js, md


def pct(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:  # pragma: no cover
        return "n/a"
