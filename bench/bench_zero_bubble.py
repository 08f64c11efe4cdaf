"""Zero-bubble benchmark: ZB-H1 beside our 1F1B and beside torch's zero-bubble schedules.

    OMP_NUM_THREADS=1 python bench/bench_zero_bubble.py            # pp=2 and pp=4, M=8
    python bench/bench_zero_bubble.py --steps 4 --repeats 1         # shorter
    python bench/bench_zero_bubble.py --split-only                  # only the one-process B/W cost

The model, data and loss are bench_pp.py's (L=8 pre-LN MLP blocks, hidden 256, FFN 4h, fp32, MSE),
on real processes (gloo over 127.0.0.1, one thread each). Per pipeline size it runs, interleaved:

* ``ours 1F1B``: ``PipelineExecutor`` on ``schedule_steps``;
* ``ours ZB-H1``: the executor on ``zb_h1_steps``, W restarting from B's recorded gradients;
* ``ours ZB-H1 replay``: the same with ``reuse_saved_gradients=False`` (W replays the backward);
* ``ours ZB-V``: the executor on ``zb_v_steps``, two chunks per rank in the V placement (loss on rank 0);
* ``torch 1F1B``, ``torch ZB (interleaved)``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` and
  ``ScheduleInterleavedZeroBubble`` with one stage per rank;
* ``torch ZBV``: ``ScheduleZBVZeroBubble``, two stages per rank in a V (rank r holds r and 2p-1-r).

Every run records each rank's CPU time per step (``process_time``), the figure to compare on a loaded
machine. For our runs it also records, on every rank, every F, B and W, and the executor's timeline:
each step's start and end and its wait for a message, and when each message was posted. The run of
each rank is split into message waits and busy stretches, each stretch given to the step it belongs
to (its compute and the executor's work around it). The simulator then replays every measured
training step, each step taking its own busy time and each hop between ranks the one-way latency
(from a ping-pong before the steps, and from the run's own messages), and its idle time per rank
(makespan minus busy) is printed beside the measured one. Results go
to bench/results/bench_zero_bubble.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pp  # noqa: E402  (the model and data; imports common, which sets OMP_NUM_THREADS=1)
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

IMPLS = ["ours 1F1B", "ours ZB-H1", "ours ZB-H1 replay", "ours ZB-V", "torch 1F1B", "torch ZB (interleaved)",
         "torch ZBV"]


# ======================================================================================
# our executor, with every compute step timed
# ======================================================================================
class StepClock:
    """Seconds spent computing each (kind, microbatch) step on this rank."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)

    def wrap(self, fn, kind: str):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.times[kind].append(time.perf_counter() - t0)
        return timed


class ExecutorTimeline:
    """Each executor step's start and end, the wait for its message (if any), and when each pipeline
    message was posted, keyed ``(direction, microbatch, receiving stage)``. ``perf_counter`` is the
    system's monotonic clock, so times compare across processes on one host."""

    def __init__(self) -> None:
        self.steps: list[list] = []  # [start, end, wait start or None, wait end or None]
        self.sent: dict[tuple, float] = {}
        self.waited: dict[tuple, tuple[float, float]] = {}
        self._current: tuple | None = None

    def install(self, rank: int) -> None:
        from megastrategy.pipeline import executor, p2p

        line = self

        def sending(orig):
            def send(run, i, direction, tensor, mb):
                orig(run, i, direction, tensor, mb)
                stage = run.ex.placement.stage(rank, run.plan[i][1])
                line.sent[(direction, mb, stage + (1 if direction == "forward" else -1))] = time.perf_counter()
            return send

        def stepping(orig, direction):
            def step(run, *args):
                chunk, mb = (args[0], args[1]) if direction is None else (args[1], args[2])
                line._current = (direction, mb, run.ex.placement.stage(rank, chunk))
                record = [time.perf_counter(), None, None, None]
                line.steps.append(record)
                try:
                    return orig(run, *args)
                finally:
                    record[1] = time.perf_counter()
            return step

        def waiting(orig):
            def wait(handle, *a, **k):
                t0 = time.perf_counter()
                try:
                    return orig(handle, *a, **k)
                finally:
                    line.steps[-1][2:] = [t0, time.perf_counter()]
                    line.waited[line._current] = (t0, time.perf_counter())
            return wait

        executor._ScheduleRun.send = sending(executor._ScheduleRun.send)
        executor._ScheduleRun.forward = stepping(executor._ScheduleRun.forward, "forward")
        executor._ScheduleRun.backward = stepping(executor._ScheduleRun.backward, "backward")
        executor._ScheduleRun.weight_gradients = stepping(executor._ScheduleRun.weight_gradients, None)
        p2p.RecvHandle.wait = waiting(p2p.RecvHandle.wait)

    def take(self, run_start: float, run_end: float) -> dict:
        """This training step's record: the busy time of every executor step (see :func:`busy_times`)
        and the messages; then start afresh."""
        out = {"busy": busy_times(self.steps, run_start, run_end),
               "sent": [[*k, v] for k, v in self.sent.items()], "waited": [[*k, *v] for k, v in self.waited.items()]}
        self.steps, self.sent, self.waited = [], {}, {}
        return out


def busy_times(steps: list[list], run_start: float, run_end: float) -> list[float]:
    """Split the rank's run into its message waits and busy stretches, and give each executor step
    the busy stretch from the moment it may proceed (its wait ended, or it began) to the moment the
    next step starts waiting (or begins); the stretch before the first step goes to the first."""
    resume = [w1 if w1 is not None else s for s, _, _, w1 in steps]
    pause = [w0 if w0 is not None else s for s, _, w0, _ in steps[1:]] + [run_end]
    busy = [p - r for r, p in zip(resume, pause)]
    if busy:
        first_pause = steps[0][2] if steps[0][2] is not None else steps[0][0]
        busy[0] += first_pause - run_start
    return busy


def in_step_latency(ranks: list[dict]) -> float | None:
    """Median seconds from a message's post to the end of its receiver's wait, over the messages whose
    receiver was already waiting when they were posted (None if there were none)."""
    samples = []
    for s in range(len(ranks[0]["records"])):
        sent = {tuple(x[:3]): x[3] for r in ranks for x in r["records"][s]["timeline"]["sent"]}
        for r in ranks:
            for *key, t0, t1 in r["records"][s]["timeline"]["waited"]:
                posted = sent.get(tuple(key))
                if posted is not None and t0 < posted:
                    samples.append(t1 - posted)
    return statistics.median(samples) if samples else None


def one_way_latency(rank: int, pp: int, nbytes: int, rounds: int = 30) -> float | None:
    """Seconds for one ``nbytes`` message between ranks 0 and 1: median ping-pong round trip / 2."""
    import torch.distributed as dist

    if rank > 1:
        return None
    buf, trips = torch.zeros(nbytes // 4), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2


def _time_backwards(clock: StepClock, split: bool) -> None:
    """Time the backward compute steps of our executor: B and W (split), or every whole backward
    (all of them go through ``torch.autograd.backward``); receive waits are outside both."""
    from megastrategy.pipeline import executor as executor_module
    from megastrategy.pipeline import split_backward

    if split:
        executor_module.backward_input = clock.wrap(split_backward.backward_input, "B")
        split_backward.WeightGradients.run = clock.wrap(split_backward.WeightGradients.run, "W")
    else:
        torch.autograd.backward = clock.wrap(torch.autograd.backward, "whole")


def ours_worker(rank: int, world: int, impl: str, m: int, mb: int, seq: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    from megastrategy.pipeline import assign_layers
    from megastrategy.pipeline.executor import PipelineExecutor
    from megastrategy.pipeline.p2p import PipelineCommunicator

    pp = world
    name, vp, placement = _our_layout(impl, pp)
    blocks = bench_pp.build_blocks()
    chunks = [nn.Sequential(*(blocks[i] for i in layers))
              for layers in assign_layers(bench_pp.LAYERS, pp, vp, placement)[rank]]
    params = [p for c in chunks for p in c.parameters()]
    x, y = bench_pp.make_data(m, mb, seq)
    xs, ys = x.chunk(m), y.chunk(m)
    comm = PipelineCommunicator(pp_group=dist.group.WORLD, pp_ranks=list(range(pp)), pp_rank=rank, device="cpu")
    ex = PipelineExecutor(comm, pp_size=pp, pp_rank=rank, vp_size=vp, placement=placement,
                          reuse_saved_gradients=not impl.endswith("replay"))
    order = _our_order(impl, m, pp, rank)
    latency = one_way_latency(rank, pp, xs[0].numel() * xs[0].element_size())
    clock = StepClock()
    _time_backwards(clock, split="ZB" in impl)
    line = ExecutorTimeline()
    line.install(rank)

    def forward_step(chunk, i, inp):
        h = chunks[chunk](xs[i] if inp is None else inp)
        return F.mse_loss(h, ys[i]) if placement.stage(rank, chunk) == pp * vp - 1 else h

    timed_forward = clock.wrap(forward_step, "F")
    records = []
    for step in range(warmup + steps):
        for p in params:
            p.grad = None
        clock.times.clear()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = ex.run(order, forward_step=timed_forward, num_microbatches=m, loss_scale=1.0 / m)
        t1 = time.perf_counter()
        elapsed, cpu = t1 - t0, time.process_time() - c0
        timeline = line.take(t0, t1)
        if step >= warmup:
            records.append({"step": elapsed, "cpu": cpu, "times": {k: list(v) for k, v in clock.times.items()},
                            "timeline": timeline})
    grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in params)
    return {"records": records, "losses": [float(v) for v in out], "grad_sq": grad_sq, "latency": latency}


def _our_layout(impl: str, pp: int):
    """(schedule name, chunks per rank, placement) of one of our implementations."""
    from megastrategy.pipeline import schedule_placement

    name = "zb_v" if impl == "ours ZB-V" else "zb_h1" if "ZB" in impl else "1f1b"
    vp = 2 if name == "zb_v" else 1
    return name, vp, schedule_placement(name, pp, vp)


def _our_order(impl: str, m: int, pp: int, rank: int):
    from megastrategy.pipeline import training_steps

    name, vp, _ = _our_layout(impl, pp)
    return training_steps(name, m, pp, rank, vp)


# ======================================================================================
# torch.distributed.pipelining
# ======================================================================================
def torch_worker(rank: int, world: int, impl: str, m: int, mb: int, seq: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    pp = world
    blocks = bench_pp.build_blocks()
    v = 2 if impl == "torch ZBV" else 1
    from megastrategy.pipeline import assign_layers

    per_stage = [idx for rank_chunks in assign_layers(bench_pp.LAYERS, pp * v, 1) for idx in rank_chunks]
    stage_ids = [rank, 2 * pp - 1 - rank] if v == 2 else [rank]
    stages = [PipelineStage(nn.Sequential(*(blocks[i] for i in per_stage[s])), s, pp * v, torch.device("cpu"),
                            group=dist.group.WORLD) for s in stage_ids]
    kinds = {"torch 1F1B": ts.Schedule1F1B, "torch ZB (interleaved)": ts.ScheduleInterleavedZeroBubble,
             "torch ZBV": ts.ScheduleZBVZeroBubble}
    cls = kinds[impl]
    schedule = cls(stages[0], m, loss_fn=F.mse_loss) if cls is ts.Schedule1F1B else cls(stages, m, loss_fn=F.mse_loss)
    x, y = bench_pp.make_data(m, mb, seq)
    first = 0 in stage_ids
    last = (pp * v - 1) in stage_ids
    params = [p for s in stages for p in s.submod.parameters()]
    records = []
    for step in range(warmup + steps):
        for p in params:
            p.grad = None
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses: list = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None,
                      return_outputs=False)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if step >= warmup:
            records.append({"step": elapsed, "cpu": cpu, "times": {}})
    grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in params)
    return {"records": records, "losses": [float(v.detach()) for v in losses], "grad_sq": grad_sq}


# ======================================================================================
COMPUTE = ("F", "B", "W", "whole")


def simulated_idle(pp: int, m: int, impl: str, ranks: list[dict], latency: float) -> list[float]:
    """The simulator's idle seconds per rank, replaying each measured training step: every step takes
    the busy time it took (:func:`busy_times`: its compute and the executor's work around it) and
    every hop between ranks ``latency`` seconds. Averaged over the training steps."""
    from megastrategy.pipeline import simulate_steps

    _, vp, placement = _our_layout(impl, pp)
    orders = [_our_order(impl, m, pp, r) for r in range(pp)]
    idle = [0.0] * pp
    n = len(ranks[0]["records"])
    for s in range(n):
        durations = []
        for rank, r in enumerate(ranks):
            busy = r["records"][s]["timeline"]["busy"]
            assert len(busy) == len(orders[rank]), (len(busy), len(orders[rank]))
            durations.append(dict(zip(orders[rank], busy)))
        stats = simulate_steps(orders, vp, step_time=lambda rank, step: durations[rank][step],
                               placement=placement, p2p_time=latency)
        idle = [a + b / n for a, b in zip(idle, stats.idle)]
    return idle


def summarize(pp: int, m: int, impl: str, ranks: list[dict], ref: dict) -> dict:
    n = len(ranks[0]["records"])
    makespan = [max(r["records"][s]["step"] for r in ranks) for s in range(n)]
    out = {"impl": impl, "pp": pp, "step_ms": statistics.median(makespan) * 1e3,
           "cpu_ms": [statistics.median(rec["cpu"] for rec in r["records"]) * 1e3 for r in ranks]}
    losses = next(r["losses"] for r in reversed(ranks) if r["losses"])
    out["loss_rel_err"] = abs(sum(losses) / len(losses) - ref["loss"]) / abs(ref["loss"])
    out["grad_rel_err"] = abs(sum(r["grad_sq"] for r in ranks) ** 0.5 - ref["grad_norm"]) / ref["grad_norm"]
    if impl.startswith("ours"):
        idle = []
        for r in ranks:  # per step: the makespan minus the rank's busy time (waits and the tail after it)
            idle.append(statistics.mean(makespan[s] - sum(r["records"][s]["timeline"]["busy"]) for s in range(n)))
        out["idle_ms"] = [i * 1e3 for i in idle]
        out["latency_ms"] = ranks[0]["latency"] * 1e3
        in_step = in_step_latency(ranks)
        out["in_step_latency_ms"] = None if in_step is None else in_step * 1e3
        out["sim_idle_ms"] = [i * 1e3 for i in simulated_idle(pp, m, impl, ranks, ranks[0]["latency"])]
        if in_step is not None:
            out["sim_idle_in_step_ms"] = [i * 1e3 for i in simulated_idle(pp, m, impl, ranks, in_step)]
        out["times_ms"] = {k: statistics.mean(t for rec in ranks[1]["records"] for t in rec["times"].get(k, [0.0])) * 1e3
                           for k in COMPUTE}
        out["times_ms"]["wait"] = statistics.mean(  # per received message, from the timeline
            t1 - t0 for rec in ranks[1]["records"] for *_, t0, t1 in rec["timeline"]["waited"]) * 1e3
    return out


def split_cost(mb: int, seq: int, layers: int, repeats: int) -> dict[str, float]:
    """One process, one stage of ``layers`` blocks: milliseconds of a whole backward, of B + W with
    W restarting from B's recorded gradients, and of B + W replaying the backward (min over
    ``repeats`` interleaved runs), plus B's own share."""
    from megastrategy.pipeline.split_backward import backward_input

    blocks = nn.Sequential(*list(bench_pp.build_blocks())[:layers])
    x = torch.randn(mb, seq, bench_pp.HIDDEN)
    grad = torch.randn(mb, seq, bench_pp.HIDDEN)
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    for _ in range(repeats):
        for variant in ("whole", "split", "replay"):
            inp = x.clone().requires_grad_(True)
            out = blocks(inp)
            t0 = time.perf_counter()
            if variant == "whole":
                torch.autograd.backward(out, grad)
            else:
                w = backward_input(out, grad, inp, reuse_saved_gradients=variant == "split")
                best[f"{variant} B"] = min(best[f"{variant} B"], time.perf_counter() - t0)
                w.run()
            best[variant] = min(best[variant], time.perf_counter() - t0)
            blocks.zero_grad(set_to_none=True)
    return {k: v * 1e3 for k, v in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--mb", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs per implementation; best median kept")
    p.add_argument("--impls", nargs="+", default=IMPLS)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--split-only", action="store_true", help="only the one-process backward cost table")
    p.add_argument("--out-dir", type=Path, default=common.RESULTS)
    a = p.parse_args()
    info = common.machine_info()
    report = common.Report("bench_zero_bubble", "Zero-bubble pipeline schedules", info, vars(a) | {"out_dir": None})
    cost = split_cost(a.mb, a.seq, bench_pp.LAYERS // 2, repeats=30)
    report.table("Backward of one stage (4 blocks), one process: whole vs split (min of 30 interleaved runs)",
                 ["variant", "ms", "/ whole", "of which B ms"],
                 [["whole backward", cost["whole"], 1.0, None],
                  ["B + W, W from recorded gradients", cost["split"], cost["split"] / cost["whole"], cost["split B"]],
                  ["B + W, W replays the backward", cost["replay"], cost["replay"] / cost["whole"], cost["replay B"]]])
    ref = bench_pp.serial_reference(a.microbatches, a.mb, a.seq) if not a.split_only else None
    best: dict[tuple[int, str], dict] = {}
    failed: dict[tuple[int, str], str] = {}
    for rep in range(0 if a.split_only else a.repeats):
        for pp in a.pp:
            for impl in a.impls:
                worker = ours_worker if impl.startswith("ours") else torch_worker
                try:
                    ranks = common.spawn(worker, pp, impl, a.microbatches, a.mb, a.seq, a.steps, a.warmup,
                                         timeout=a.timeout)
                except RuntimeError as err:  # e.g. a torch build whose ZBV schedule fails: report, go on
                    failed[(pp, impl)] = str(err).strip().splitlines()[-1][:200]
                    print(f"  [pp={pp} {impl} run {rep + 1}: FAILED: {failed[(pp, impl)]}]", flush=True)
                    continue
                r = summarize(pp, a.microbatches, impl, ranks, ref)
                print(f"  [pp={pp} {impl} run {rep + 1}: median step {r['step_ms']:.1f} ms, load "
                      f"{common.load_average()}]", flush=True)
                if (pp, impl) not in best or r["step_ms"] < best[(pp, impl)]["step_ms"]:
                    best[(pp, impl)] = r
    if best:
        _tables(report, a, best)
    if failed:
        report.table("Implementations that failed (left out of the tables above)", ["pp", "schedule", "error"],
                     [[f"pp={pp}", impl, why] for (pp, impl), why in sorted(failed.items())])
    js, md = report.save(a.out_dir)
    print(f"wrote {js} and {md}")


def _tables(report: common.Report, a, best: dict) -> None:
    rows = []
    for pp in a.pp:
        base = best.get((pp, "ours 1F1B"))
        for impl in a.impls:
            r = best.get((pp, impl))
            if r is None:
                continue
            cpu = statistics.mean(r["cpu_ms"])
            rows.append([f"pp={pp}", impl, r["step_ms"], common.ratio(r["step_ms"], base and base["step_ms"]),
                         common.ratio(best[(pp, "ours ZB-H1")]["step_ms"], r["step_ms"]) if (pp, "ours ZB-H1") in best else None,
                         bench_pp.lst(r["cpu_ms"], 1), common.ratio(cpu, base and statistics.mean(base["cpu_ms"])),
                         f"{r['loss_rel_err']:.1e}", f"{r['grad_rel_err']:.1e}"])
    report.table("Step time (median over steps, best of repeats) and CPU time per rank (median process_time)",
                 ["pp", "schedule", "step ms", "/ ours 1F1B", "ours ZB-H1 / this", "CPU ms per rank",
                  "mean CPU / ours 1F1B", "loss rel err", "grad rel err"], rows,
                 notes=[f"M={a.microbatches}, {a.mb}x{a.seq} tokens per microbatch, load {common.load_average()}"])
    rows = []
    for (pp, impl), r in sorted(best.items()):
        if "idle_ms" in r:
            sims = [r["sim_idle_ms"], r.get("sim_idle_in_step_ms")]
            errs = [None if sim is None else bench_pp.lst(
                [abs(x - y) / y for x, y in zip(r["idle_ms"], sim) if y > 0], 2) for sim in sims]
            in_step = r.get("in_step_latency_ms")
            rows.append([f"pp={pp}", impl, bench_pp.lst(r["idle_ms"], 1), bench_pp.lst(sims[0], 1), errs[0],
                         f"{r['latency_ms']:.2f}", None if sims[1] is None else bench_pp.lst(sims[1], 1), errs[1],
                         None if in_step is None else f"{in_step:.2f}",
                         " / ".join(f"{k} {v:.2f}" for k, v in r["times_ms"].items() if v)])
    report.table("Idle per rank: measured (makespan minus the rank's busy time) beside the simulator replaying "
                 "each measured step (each step its own busy time), with the ping-pong latency per hop and with "
                 "the latency measured on the run's own messages",
                 ["pp", "schedule", "measured idle ms", "simulated idle ms (ping-pong)", "relative difference",
                  "ping-pong latency ms", "simulated idle ms (in-step)", "relative difference",
                  "in-step latency ms", "rank 1 mean step ms"], rows)


if __name__ == "__main__":
    main()
