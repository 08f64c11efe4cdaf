"""Mixture-of-experts benchmark: throughput of one ``MoELayer`` at ep = 1, 2, 4 and the bytes its
token exchange moves, beside the minimum.

    OMP_NUM_THREADS=1 python bench/bench_moe.py                 # about a minute on 2 cores
    python bench/bench_moe.py --iters 20 --tokens 2048          # longer / bigger

Setup (real processes, gloo over 127.0.0.1, one thread each): one MoE layer, hidden 256, FFN
512 per expert, 8 experts, top-2, fp32, ``--tokens`` tokens per process. ``ep`` processes,
tensor parallelism off, so the world is ep × (dense data parallel = ep): every process routes
its own tokens. Each step is one forward + backward.

1. Throughput: step time (median over iterations of the slowest rank) and tokens/s over the
   world, for the all-to-all dispatcher (and the all-gather one for comparison). On a machine
   with fewer cores than processes the processes share cores: read tokens/s per core then.
2. Traffic per step (forward + backward, summed over ranks), from ``record_collectives()``:
   the rows every rank hands to ``all_to_all_single`` (its own share included) beside the
   minimum, every routed (token, expert) pair sent once each way (dispatch, combine, and the
   same two in backward): ``4 · T · k · H · 4 bytes`` per rank. The part that really leaves a
   rank (rows for experts on other ranks) is shown too, with the count exchange (a few bytes).

Results are printed and written to bench/results/bench_moe.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, spawn  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch; puts src/ on sys.path)

import torch  # noqa: E402

HIDDEN, FFN, EXPERTS, TOP_K = 256, 512, 8, 2


# ======================================================================================
# the measurement
# ======================================================================================
def moe_worker(rank: int, world: int, dispatcher: str, tokens: int, iters: int, warmup: int) -> dict:
    from megastrategy.layers.mappings import record_collectives
    from megastrategy.moe import MoELayer
    from megastrategy.moe.integration import shard_moe_layers
    from megastrategy.parallel_state import ParallelLayout, ParallelState

    ps = ParallelState(ParallelLayout(world_size=world, ep=world), rank)
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, FFN, EXPERTS, top_k=TOP_K, dispatcher=dispatcher)
    shard_moe_layers(layer, ps)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).requires_grad_(True)
    gy = torch.randn(tokens, HIDDEN, generator=g)
    times = []
    records = None
    remote = 0
    for it in range(warmup + iters):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        with record_collectives() as log:
            y = layer(x)
            (y * gy).sum().backward()
        times.append(time.perf_counter() - t0)
        if it == 0:
            records = list(log)
            with torch.no_grad():
                owner = layer.router(x).indices // (EXPERTS // world)
                remote = int((owner != ps.ep_rank).sum())
    step = statistics.median(times[warmup:])
    by_op: dict[str, int] = {}
    for r in records:
        by_op[r.op] = by_op.get(r.op, 0) + r.bytes
    ps.destroy()
    return {"step_s": step, "bytes": by_op, "remote_assignments": remote}


def run(dispatcher: str, ep: int, tokens: int, iters: int, warmup: int) -> dict:
    per_rank = spawn(moe_worker, ep, dispatcher, tokens, iters, warmup, timeout=600.0)
    step = max(r["step_s"] for r in per_rank)
    ops: dict[str, int] = {}
    for r in per_rank:
        for k, v in r["bytes"].items():
            ops[k] = ops.get(k, 0) + v
    row_bytes = HIDDEN * 4
    minimum = 4 * ep * tokens * TOP_K * row_bytes if ep > 1 else 0
    remote_min = 4 * sum(r["remote_assignments"] for r in per_rank) * row_bytes
    return {
        "dispatcher": dispatcher,
        "ep": ep,
        "step_ms": step * 1e3,
        "tokens_per_s": ep * tokens / step,
        "a2a_bytes": ops.get("all_to_all", 0),
        "min_bytes": minimum,
        "remote_min_bytes": remote_min,
        "count_bytes": ops.get("all_to_all_counts", 0) + ops.get("all_gather", 0),
        "gather_bytes": ops.get("all_gather_v", 0) + ops.get("reduce_scatter_v", 0),
        "ops": ops,
    }


# ======================================================================================
# report
# ======================================================================================
def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.3g}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], md: bool) -> str:
    cells = [list(map(str, headers))] + [[_fmt(c) for c in r] for r in rows]
    if md:
        out = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in cells[1:]])
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(n) for c, n in zip(cells[0], w)), "-+-".join("-" * n for n in w)]
    return "\n".join(lines + [" | ".join(c.rjust(n) for c, n in zip(r, w)) for r in cells[1:]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per process")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-allgather", action="store_true")
    args = ap.parse_args()
    eps = [int(e) for e in args.eps.split(",")]
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    config = {"hidden": HIDDEN, "ffn": FFN, "experts": EXPERTS, "top_k": TOP_K, "tokens_per_process": args.tokens,
              "iters": args.iters, "warmup": args.warmup, "dtype": "fp32"}
    dispatchers = ["alltoall"] + ([] if args.no_allgather else ["allgather"])
    results = [run(d, ep, args.tokens, args.iters, args.warmup) for d in dispatchers for ep in eps]

    thr_headers = ["dispatcher", "ep (= processes)", "step ms", "tokens/s (world)", "tokens/s per process"]
    thr_rows = [[r["dispatcher"], r["ep"], r["step_ms"], r["tokens_per_s"], r["tokens_per_s"] / r["ep"]] for r in results]
    byte_headers = ["dispatcher", "ep", "token exchange bytes", "minimum (each routed token once each way)", "ratio",
                    "of which must leave a rank", "count exchange bytes", "collectives"]
    byte_rows = [[r["dispatcher"], r["ep"], r["a2a_bytes"] + r["gather_bytes"], r["min_bytes"],
                  ((r["a2a_bytes"] + r["gather_bytes"]) / r["min_bytes"]) if r["min_bytes"] else "-",
                  r["remote_min_bytes"], r["count_bytes"],
                  ", ".join(f"{k}" for k in sorted(r["ops"]) if not k.startswith("all_to_all_counts"))]
                 for r in results]
    notes = [
        f"machine: {info['cores']} cores ({info['usable_cores']} usable), torch {info['torch']}, python {info['python']}; "
        f"processes beyond the core count share cores, so tokens/s at ep=4 on 2 cores measures contention, not scaling.",
        "bytes are per step (forward + backward) summed over ranks, from record_collectives(): every row a rank hands "
        "to all_to_all_single, its own share included (for the all-gather dispatcher: the uneven all-gathers of "
        "tokens, router weights and indices and the reduce-scatter of outputs, built on all_to_all_single too); "
        "minimum = 4 x ranks x T x k x H x 4 B (dispatch and combine, forward and backward).",
        "'must leave a rank' counts only the assignments whose expert lives on another rank (the rest is a local copy).",
    ]
    out = [f"# MoE layer benchmark ({info['date']})", "", "config: `" + json.dumps(config) + "`", "",
           "## Throughput", "", _table(thr_headers, thr_rows, True), "",
           "## Token-exchange traffic per step", "", _table(byte_headers, byte_rows, True), ""]
    out += [f"* {n}" for n in notes]
    print("## Throughput\n" + _table(thr_headers, thr_rows, False) + "\n")
    print("## Token-exchange traffic per step\n" + _table(byte_headers, byte_rows, False) + "\n")
    for n in notes:
        print(f"  * {n}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_moe.json").write_text(json.dumps({"machine": info, "config": config, "results": results}, indent=1))
    (RESULTS / "bench_moe.md").write_text("\n".join(out) + "\n")
    print(f"\nwritten: {RESULTS / 'bench_moe.md'}")


if __name__ == "__main__":
    main()
