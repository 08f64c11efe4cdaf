"""cProfile of the Lightning side of bench_pp_peers.py: where a pipelined training or validation step's CPU goes.

    OMP_NUM_THREADS=1 python bench/profile_lightning_pp.py                   # pp=2, h64, training
    python bench/profile_lightning_pp.py --hidden 256 --stage validation --top 30

``profile_pp_step.py`` profiles the executor alone; this one profiles the whole step a user runs
(Lightning's loop, the strategy, the user's step on every stage, the output relay, the optimizer)
on bench_pp_peers.py's BERT. Each rank profiles the steps after ``--warmup`` (between Lightning's
``on_*_batch_start`` and ``on_*_batch_end``) with per-thread CPU time as the clock, so waiting
for the other rank costs nothing and a loaded machine's descheduling does not count. The worker
threads that run paused user steps on the stages before the last are profiled too, and their CPU
is reported separately. Printed per rank: CPU ms per step (main thread, step threads) and the top
functions by self time and by cumulative time.
"""
from __future__ import annotations

import cProfile
import json
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pp_peers as peers  # noqa: E402
from common import launch_script  # noqa: E402

import torch  # noqa: E402


class _Profiles:
    """One cProfile per thread (main thread and each step thread), on during measured steps only."""

    def __init__(self) -> None:
        self.on = False
        self.main = cProfile.Profile(time.thread_time)
        self.threads: list[cProfile.Profile] = []
        self._local = threading.local()

    def thread_profile(self) -> cProfile.Profile:
        prof = getattr(self._local, "prof", None)
        if prof is None:
            prof = self._local.prof = cProfile.Profile(time.thread_time)
            self.threads.append(prof)
        return prof


def _patch_step_threads(profiles: _Profiles) -> None:
    """Profile each paused user step's run on its worker thread while measuring."""
    from megastrategy.pipeline import suspended_step

    original = suspended_step.SuspendedStep._run

    def run(self, body):
        if not profiles.on:
            return original(self, body)
        prof = profiles.thread_profile()
        prof.enable()
        try:
            return original(self, body)
        finally:
            prof.disable()

    suspended_step.SuspendedStep._run = run


def _profiler_callback(profiles: _Profiles, stage: str, warmup: int):
    import lightning as L

    class Profiler(L.Callback):
        def __init__(self) -> None:
            self.seen, self.measured = 0, 0

        def _start(self) -> None:
            self.seen += 1
            if self.seen > warmup:
                profiles.on = True
                profiles.main.enable()

        def _end(self) -> None:
            if profiles.on:
                profiles.main.disable()
                profiles.on = False
                self.measured += 1

    cb = Profiler()
    name = "train" if stage == "training" else "validation"
    setattr(cb, f"on_{name}_batch_start", lambda *a, **k: cb._start())
    setattr(cb, f"on_{name}_batch_end", lambda *a, **k: cb._end())
    return cb


def _top(stats: pstats.Stats, key: str, n: int, steps: int) -> list[str]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:
        cc, nc, tt, ct, _ = stats.stats[func]
        path, line, name = func
        short = name if path == "~" else f"{'/'.join(Path(path).parts[-2:])}:{line} {name}"
        rows.append(f"{tt / steps * 1e3:8.2f} {ct / steps * 1e3:8.2f} {nc / steps:8.1f}  {short}")
    return rows


def worker(cfg: dict) -> None:
    import os

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    profiles = _Profiles()
    _patch_step_threads(profiles)
    cb = _profiler_callback(profiles, cfg["stage"], cfg["warmup"])
    stage = "fit" if cfg["stage"] == "training" else "validate"
    peers.lightning_run(cfg["hidden"], cfg["pp"], cfg["steps"], [cb], stages=(stage,))
    steps = max(cb.measured, 1)
    main = pstats.Stats(profiles.main)
    main_ms = main.total_tt / steps * 1e3
    thread_ms = sum(pstats.Stats(p).total_tt for p in profiles.threads) / steps * 1e3
    lines = [f"rank {rank}: {steps} steps, CPU per step: main thread {main_ms:.1f} ms, step threads {thread_ms:.1f} ms",
             "  self ms   cum ms  calls/step  function (main thread, by self time)"]
    lines += _top(main, "tottime", cfg["top"], steps)
    lines += ["  self ms   cum ms  calls/step  function (main thread, by cumulative time)"]
    lines += _top(main, "cumulative", cfg["top"], steps)
    if profiles.threads:
        threads = pstats.Stats(profiles.threads[0])
        for p in profiles.threads[1:]:
            threads.add(p)
        lines += ["  self ms   cum ms  calls/step  function (step threads, by self time)"]
        lines += _top(threads, "tottime", cfg["top"], steps)
    Path(f"{cfg['out']}.rank{rank}.txt").write_text("\n".join(lines))
    main.dump_stats(f"{cfg['out']}.rank{rank}.main.prof")


def main() -> None:
    p = peers.step_parser(__doc__, steps=25)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    out = Path(tempfile.mkdtemp(prefix="megaprofile-")) / "run"
    cfg = {k: getattr(args, k) for k in ("pp", "hidden", "stage", "steps", "warmup", "top")} | {"out": str(out)}
    launch_script(Path(__file__).resolve(), args.pp, ["--worker", json.dumps(cfg)], args.timeout)
    for rank in range(args.pp):
        print(Path(f"{out}.rank{rank}.txt").read_text(), "\n")
    print(f"raw main-thread profiles (pstats): {out}.rank*.main.prof")


if __name__ == "__main__":
    main()
