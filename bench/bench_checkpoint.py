"""Checkpoint stall: how long training waits per save, synchronous vs ``async_checkpoint=True``.

    OMP_NUM_THREADS=1 python bench/bench_checkpoint.py            # ~1 min on 2 cores
    python bench/bench_checkpoint.py --width 1024 --layers 8 --saves 3

Two processes (gloo), each holding the same MLP (``layers`` x Linear(width, width)) and its
AdamW state (moments and step), save the sharded checkpoint ``saves`` times to one folder.
Measured per save (the slowest rank): the *stall* (time until the save call returns, i.e. until
training could go on) and the time until the checkpoint has its final name (for async saves the
stall plus the background write, waited for right after). Results go to
bench/results/bench_checkpoint.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import RESULTS, machine_info, machine_line, md_table, spawn, text_table  # noqa: I001 - sets paths first


def _run(rank: int, world: int, width: int, layers: int, saves: int, folder: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from megastrategy.checkpoint.async_writer import AsyncCheckpointWriter
    from megastrategy.checkpoint.sharded import save_sharded

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    out = {"numel": sum(p.numel() for p in model.parameters())}
    for mode in ("sync", "async"):
        writer = AsyncCheckpointWriter() if mode == "async" else None
        stalls, totals = [], []
        for i in range(saves):
            dist.barrier()
            start = time.perf_counter()
            kw = {"write": writer.submit} if writer is not None else {}
            save_sharded(Path(folder) / f"{mode}-{i}", module=model, optimizers=[opt], is_coordinator=rank == 0, **kw)
            stalls.append(time.perf_counter() - start)
            if writer is not None:
                writer.wait()
                totals.append(time.perf_counter() - start)
        out[mode] = {"stall_s": stalls, "total_s": totals or stalls}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    info = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as folder:
        results = spawn(_run, 2, args.width, args.layers, args.saves, folder, timeout=args.timeout)
    r0 = results[0]
    size_mb = r0["numel"] * 4 * 3 / 2**20  # weights + two Adam moments, fp32
    rows = []
    for mode in ("sync", "async"):
        stalls = [max(r[mode]["stall_s"][i] for r in results) for i in range(args.saves)]
        totals = [max(r[mode]["total_s"][i] for r in results) for i in range(args.saves)]
        rows.append([mode, f"{statistics.median(stalls) * 1000:.0f}", f"{min(stalls) * 1000:.0f}-{max(stalls) * 1000:.0f}",
                     f"{statistics.median(totals) * 1000:.0f}"])
    headers = ["save", "stall per save, median (ms)", "stall range (ms)", "until on disk, median (ms)"]
    title = f"{r0['numel']:,} parameters + AdamW state ({size_mb:.0f} MiB), 2 processes, {args.saves} saves each"
    print(machine_line(info))
    print(title)
    print(text_table(headers, rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_checkpoint.json").write_text(json.dumps({"machine": info, "args": vars(args), "ranks": results}))
    (RESULTS / "bench_checkpoint.md").write_text(f"{machine_line(info)}\n\n{title}\n\n{md_table(headers, rows)}\n")


if __name__ == "__main__":
    main()
