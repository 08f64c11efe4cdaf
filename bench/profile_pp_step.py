"""cProfile of pipelined training steps (bench_pp.py's model, 1F1B, gloo): where a step's CPU goes.

    OMP_NUM_THREADS=1 python bench/profile_pp_step.py             # pp=2, M=8, 10 profiled steps
    python bench/profile_pp_step.py --pp 4 --microbatches 8 --top 15

Each rank runs ``--warmup`` unprofiled steps (the first step describes every tensor with a
header; later ones send one predicted message per tensor), then ``--steps`` steps under
cProfile, timed by ``process_time`` (CPU time, so a loaded machine's descheduling does not
count). Printed per rank: the top functions by self CPU time (ms per step), the self time
spent in the pipeline's p2p modules, the CPU time per step (``process_time``), and the
point-to-point ops posted per step (counted at ``dist.batch_isend_irecv``). It uses only the
executor's public API, so it also profiles older checkouts (point PYTHONPATH at them).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch is imported)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def _label(func: tuple) -> str:
    path, line, name = func
    if path == "~":
        return name
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if "megastrategy" in parts or "torch" in parts else Path(path).name
    return f"{short}:{line} {name}"


def profile_worker(rank: int, world: int, m: int, mb: int, seq: int, steps: int, warmup: int, top: int) -> dict:
    import torch.distributed as dist

    import bench_pp
    from megastrategy.pipeline import assign_layers, schedule_steps
    from megastrategy.pipeline.executor import PipelineExecutor
    from megastrategy.pipeline.p2p import PipelineCommunicator

    blocks = bench_pp.build_blocks()
    chunk = nn.Sequential(*(blocks[i] for i in assign_layers(bench_pp.LAYERS, world, 1)[rank][0]))
    x, y = bench_pp.make_data(m, mb, seq)
    xs, ys = x.chunk(m), y.chunk(m)
    comm = PipelineCommunicator(pp_group=dist.group.WORLD, pp_ranks=list(range(world)), pp_rank=rank, device="cpu")
    executor = PipelineExecutor(comm, pp_size=world, pp_rank=rank)
    order = schedule_steps(m, world, rank)

    def forward_step(c: int, i: int, inp):
        h = chunk(xs[i] if inp is None else inp)
        return F.mse_loss(h, ys[i]) if rank == world - 1 else h

    ops = [0]
    real = dist.batch_isend_irecv

    def counting(p2p_ops):
        ops[0] += len(p2p_ops)
        return real(p2p_ops)

    dist.batch_isend_irecv = counting

    def step() -> None:
        for p in chunk.parameters():
            p.grad = None
        executor.run(order, forward_step=forward_step, num_microbatches=m, loss_scale=1.0 / m)

    for _ in range(warmup):
        step()
    dist.barrier()
    ops[0] = 0
    prof = cProfile.Profile(time.process_time)  # CPU time: other processes' load does not count
    c0, t0 = time.process_time(), time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # (cc, nc, tottime, cumtime, callers)
    p2p_self = sum(v[2] for k, v in rows if "pipeline/p2p" in k[0].replace(os.sep, "/"))
    return {
        "top": [(_label(k), v[1] / steps, v[2] / steps * 1e3, v[3] / steps * 1e3) for k, v in rows[:top]],
        "p2p_self_ms": p2p_self / steps * 1e3, "cpu_ms": cpu / steps * 1e3, "wall_ms": wall / steps * 1e3,
        "ops_per_step": ops[0] / steps, "load": common.load_average(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--mb", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="profiled steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    res = common.spawn(profile_worker, args.pp, args.microbatches, args.mb, args.seq, args.steps, args.warmup,
                       args.top, timeout=args.timeout)
    for rank, r in enumerate(res):
        print(f"\nrank {rank}: cpu {r['cpu_ms']:.1f} ms/step (process_time), wall {r['wall_ms']:.1f} ms/step, "
              f"p2p ops posted {r['ops_per_step']:.0f}/step, self time in pipeline/p2p*.py {r['p2p_self_ms']:.2f} "
              f"ms/step, load {r['load']}")
        print("| function | calls/step | self ms/step | cumulative ms/step |\n|---|---:|---:|---:|")
        for name, calls, tot, cum in r["top"]:
            print(f"| {name} | {calls:g} | {tot:.2f} | {cum:.2f} |")


if __name__ == "__main__":
    main()
