"""Pipeline-parallel benchmark: megastrategy's 1F1B / interleaved schedules beside
torch.distributed.pipelining, measured idle time beside the simulator, and a full
MegatronStrategy(pp=2) Lightning run.

    OMP_NUM_THREADS=1 python bench/bench_pp.py             # everything (a few minutes on 2 cores)
    python bench/bench_pp.py --skip-lightning               # only the schedule comparison
    python bench/bench_pp.py --steps 5 --microbatches 8     # shorter

Sections (real processes, gloo over 127.0.0.1, one thread each):

1. The same model (L=8 identical pre-LN MLP blocks, hidden 256, FFN 4h, fp32), split by
   ``assign_layers`` into the same stages, the same microbatches (M=8) and the same loss
   (MSE), trained one pipeline step at a time by
   * ours: ``PipelineExecutor`` + ``PipelineCommunicator`` running ``schedule_steps``;
   * torch: ``torch.distributed.pipelining`` ``PipelineStage`` + ``Schedule1F1B`` /
     ``ScheduleInterleaved1F1B``,
   for 1F1B pp=2, 1F1B pp=4 and interleaved pp=2 vp=2. Step time, activation memory, loss and
   gradient agreement with a serial reference.
2. Idle fraction per rank (measured from timed p2p waits) beside
   ``simulate_schedule(M, pp, vp, forward_time, backward_time)`` fed the measured times.
3. The round trip of one message, PipelineCommunicator vs plain gloo isend/irecv.
4. A full Lightning run of examples/pretrain_gpt.py's GPT with MegatronStrategy(pp=2) (and
   pp=2, vp=2) beside plain single-device Lightning, for context.

Results are printed and written to bench/results/bench_pp.{json,md}. Shared helpers
(launchers, tables, machine info) come from common.py, the Lightning runs from lightning_runs.py.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch is imported)
import lightning_runs  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

HIDDEN, FFN_MULT, LAYERS = 256, 4, 8
CONFIGS = [  # (label, pp, vp)
    ("1F1B pp=2", 2, 1),
    ("1F1B pp=4", 4, 1),
    ("interleaved pp=2 vp=2", 2, 2),
]


# ======================================================================================
# model and data (identical on every rank: same seeds)
# ======================================================================================
class MLPBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, FFN_MULT * h)
        self.fc2 = nn.Linear(FFN_MULT * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def build_blocks() -> nn.ModuleList:
    torch.manual_seed(1234)
    return nn.ModuleList(MLPBlock(HIDDEN) for _ in range(LAYERS))


def make_data(m: int, mb: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return torch.randn(m * mb, seq, HIDDEN, generator=gen), torch.randn(m * mb, seq, HIDDEN, generator=gen)


def serial_reference(m: int, mb: int, seq: int) -> dict[str, float]:
    """Mean microbatch loss and the global gradient norm of one step on one process."""
    blocks = build_blocks()
    x, y = make_data(m, mb, seq)
    total = 0.0
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        h = xm
        for b in blocks:
            h = b(h)
        loss = F.mse_loss(h, ym)
        (loss / m).backward()
        total += loss.item()
    sq = sum(float(p.grad.double().pow(2).sum()) for p in blocks.parameters())
    return {"loss": total / m, "grad_norm": math.sqrt(sq)}


# ======================================================================================
# measurement helpers
# ======================================================================================
class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader():
    """Bytes the C heap currently hands out (glibc ``mallinfo2``: in-use chunks of every
    arena + mmapped chunks); ``None`` where unavailable. CPU tensors live there."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return read


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """Peak bytes of distinct tensor storages autograd holds for backward (via
    ``saved_tensors_hooks``), parameters excluded. Works the same for any schedule."""

    def __init__(self, params):
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}
        self.current = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def pack(self, t):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or nbytes == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, ptr)
        return held

    @staticmethod
    def unpack(obj):
        return obj.tensor if isinstance(obj, _Held) else obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Probe:
    """Per-step timers (waits, forward and backward compute) and memory samples."""

    def __init__(self):
        self.heap = _heap_reader()
        self.sampling = False
        self.reset()

    def reset(self):
        self.wait = 0.0
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.heap_peak = 0
        self.rss_peak = 0

    def sample(self):
        if self.sampling:
            if self.heap is not None:
                self.heap_peak = max(self.heap_peak, self.heap())
            self.rss_peak = max(self.rss_peak, rss_bytes())

    def timed_wait(self, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.wait += time.perf_counter() - t0
        return wrapper

    def timed_loss(self, fn):
        """The loss counts into the forward that produced its input (as in ours, where the
        last stage's forward step computes it)."""
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if self.fwd:
                self.fwd[-1] += time.perf_counter() - t0
            self.sample()
            return out
        return wrapper

    def timed_compute(self, fn, into: str):
        def wrapper(*a, **k):
            self.sample()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            getattr(self, into).append(time.perf_counter() - t0)
            self.sample()
            return out
        return wrapper


# ======================================================================================
# one configuration on pp processes
# ======================================================================================
def pp_worker(rank: int, world: int, impl: str, vp: int, m: int, mb: int, seq: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    from megastrategy.pipeline import assign_layers, schedule_steps

    pp = world
    blocks = build_blocks()
    mine = assign_layers(LAYERS, pp, vp)[rank]  # per local chunk: indices of its blocks
    chunks = [nn.Sequential(*(blocks[i] for i in idx)) for idx in mine]
    params = [p for c in chunks for p in c.parameters()]
    x, y = make_data(m, mb, seq)
    x_mbs, y_mbs = x.chunk(m), y.chunk(m)
    probe = Probe()
    group = dist.group.WORLD

    def zero():
        for p in params:
            p.grad = None

    real_backward = torch.autograd.backward
    torch.autograd.backward = probe.timed_compute(real_backward, "bwd")  # both schedules call it
    peak_in_flight = 0
    losses: list[float] = []

    if impl == "ours":
        from megastrategy.pipeline.executor import PipelineExecutor
        from megastrategy.pipeline.p2p import PipelineCommunicator

        # every blocking wait of the communicator (headers, payloads, final send completion)
        PipelineCommunicator._wait_works = probe.timed_wait(PipelineCommunicator._wait_works)
        comm = PipelineCommunicator(pp_group=group, pp_ranks=list(range(pp)), pp_rank=rank, device="cpu")
        executor = PipelineExecutor(comm, pp_size=pp, pp_rank=rank, vp_size=vp)
        order = schedule_steps(m, pp, rank, vp)
        n_stages = pp * vp

        def forward_step(chunk: int, i: int, inp):
            h = chunks[chunk](x_mbs[i] if inp is None else inp)
            if chunk * pp + rank == n_stages - 1:
                return F.mse_loss(h, y_mbs[i])
            return h

        timed_forward = probe.timed_compute(forward_step, "fwd")

        def run_step():
            out = executor.run(order, forward_step=timed_forward, num_microbatches=m, loss_scale=1.0 / m)
            return [float(v) for v in out]

        def in_flight():
            return executor.peak_in_flight
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
        from torch.distributed.pipelining import schedules as torch_schedules

        torch_schedules._wait_batch_p2p = probe.timed_wait(torch_schedules._wait_batch_p2p)
        stages = []
        for c, module in enumerate(chunks):
            module.forward = probe.timed_compute(module.forward, "fwd")
            stages.append(PipelineStage(module, c * pp + rank, pp * vp, torch.device("cpu"), group=group))
        loss_fn = probe.timed_loss(F.mse_loss)  # loss time counts as forward, as in ours
        if vp == 1:
            schedule = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
        else:
            schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
        first = rank == 0
        last = rank == pp - 1  # holds the last (virtual) stage in both schedules
        fwd_cache_peak = [0]
        for st in stages:
            original = st.forward_one_chunk

            def counted(*a, _orig=original, **k):
                out = _orig(*a, **k)
                fwd_cache_peak[0] = max(fwd_cache_peak[0], sum(len(s.fwd_cache) for s in stages))
                return out

            st.forward_one_chunk = counted

        def run_step():
            out: list = []
            args = (x,) if first else ()
            schedule.step(*args, target=y if last else None, losses=out if last else None, return_outputs=False)
            return [float(v.detach()) for v in out]

        def in_flight():
            return fwd_cache_peak[0]

    # Memory baselines are taken before the first pipeline step, so whatever a schedule
    # allocates and keeps (receive buffers, caches) counts against it. First, everything that
    # is not the schedule's doing is initialized in both implementations alike: the pipelining
    # package is imported (its import pulls in modules that otherwise allocate ~10 MiB lazily
    # during the first backward) and every local chunk runs one forward+backward.
    from torch.distributed import pipelining as _pipelining  # noqa: F401

    for c in chunks:
        c(torch.randn(mb, seq, HIDDEN, requires_grad=True)).sum().backward()
    zero()
    heap0 = probe.heap() if probe.heap else None
    rss0 = rss_bytes()
    records = []
    for step in range(warmup + steps):
        zero()
        dist.barrier()
        probe.reset()
        c0 = time.process_time()
        t0 = time.perf_counter()
        losses = run_step()
        elapsed = time.perf_counter() - t0
        if step >= warmup:
            records.append({"step": elapsed, "cpu": time.process_time() - c0, "wait": probe.wait,
                            "fwd": list(probe.fwd), "bwd": list(probe.bwd)})

    # one more step for memory, with the saved-tensor hooks and heap sampling on (not timed)
    grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in params)
    zero()
    dist.barrier()
    saved = SavedActivations(params)
    probe.reset()
    probe.sampling = True
    with saved.hooks():
        run_step()
    probe.sampling = False
    torch.autograd.backward = real_backward
    return {
        "records": records, "losses": losses, "grad_sq": grad_sq, "saved_peak": saved.peak,
        "heap_peak_delta": (probe.heap_peak - heap0) if heap0 is not None else None,
        "rss_peak_delta": probe.rss_peak - rss0, "in_flight": in_flight(), "chunks": [list(i) for i in mine],
        "act_bytes_per_mb": mb * seq * HIDDEN * 4,
    }


# ======================================================================================
def mib(b: float | None) -> float | None:
    return None if b is None else b / 2**20


def summarize(label: str, pp: int, vp: int, impl: str, ranks: list[dict], m: int, ref: dict) -> dict:
    from megastrategy.pipeline import simulate_schedule

    n = len(ranks[0]["records"])
    t_max = [max(r["records"][s]["step"] for r in ranks) for s in range(n)]
    idle = []
    for r in ranks:
        # waits inside the step + the time the rank sat finished while the slowest one still ran
        busy_gap = sum(r["records"][s]["wait"] + t_max[s] - r["records"][s]["step"] for s in range(n))
        idle.append(busy_gap / sum(t_max))
    fwd = [t for r in ranks for rec in r["records"] for t in rec["fwd"]]
    bwd = [t for r in ranks for rec in r["records"] for t in rec["bwd"]]
    f, b = statistics.mean(fwd), statistics.mean(bwd)
    sim = simulate_schedule(m, pp, vp, forward_time=f, backward_time=b)
    loss = ranks[-1]["losses"]
    mean_loss = sum(loss) / len(loss) if loss else float("nan")
    grad_norm = math.sqrt(sum(r["grad_sq"] for r in ranks))
    return {
        "label": label, "impl": impl, "pp": pp, "vp": vp,
        "step_ms": statistics.median(t_max) * 1e3, "step_ms_all": [t * 1e3 for t in t_max],
        "saved_mib": [mib(r["saved_peak"]) for r in ranks],
        "heap_mib": [mib(r["heap_peak_delta"]) for r in ranks],
        "rss_mib": [mib(r["rss_peak_delta"]) for r in ranks],
        "cpu_ms": max(statistics.median(rec["cpu"] for rec in r["records"]) for r in ranks) * 1e3,
        "in_flight": [r["in_flight"] for r in ranks], "sim_in_flight": sim.peak_in_flight,
        "idle": idle, "idle_mean": statistics.mean(idle),
        "sim_idle": [i / sim.makespan for i in sim.idle], "sim_bubble": sim.bubble_fraction,
        "fwd_ms": f * 1e3, "bwd_ms": b * 1e3, "sim_makespan_ms": sim.makespan * 1e3,
        "wait_ms": [statistics.median(rec["wait"] for rec in r["records"]) * 1e3 for r in ranks],
        "loss_rel_err": abs(mean_loss - ref["loss"]) / abs(ref["loss"]),
        "grad_rel_err": abs(grad_norm - ref["grad_norm"]) / ref["grad_norm"],
        "act_mib_per_mb": mib(ranks[0]["act_bytes_per_mb"]),
    }


def lst(values, digits: int = 3) -> str:
    return " / ".join(common.fmt_num(v, digits) for v in values)


def section_schedules(report: common.Report, m: int, mb: int, seq: int, steps: int, warmup: int, repeats: int,
                      timeout: float) -> None:
    ref = serial_reference(m, mb, seq)
    results: dict[tuple[str, str], dict] = {}
    for rep in range(repeats):  # interleaved: ours, torch, ours, torch ...; the lowest median is kept
        for label, pp, vp in CONFIGS:
            for impl in ("ours", "torch"):
                t0 = time.perf_counter()
                ranks = common.spawn(pp_worker, pp, impl, vp, m, mb, seq, steps, warmup, timeout=timeout)
                r = summarize(label, pp, vp, impl, ranks, m, ref)
                print(f"  [{label} {impl} (run {rep + 1}/{repeats}): {time.perf_counter() - t0:.1f}s, median step "
                      f"{r['step_ms']:.1f} ms, cpu {r['cpu_ms']:.1f} ms, load {common.load_average()}]", flush=True)
                previous = results.get((label, impl))
                r["all_step_ms"] = (previous["all_step_ms"] if previous else []) + [r["step_ms"]]
                if previous is None or r["step_ms"] < previous["step_ms"]:
                    results[(label, impl)] = r
                else:
                    previous["all_step_ms"] = r["all_step_ms"]

    rows = []
    for label, pp, vp in CONFIGS:
        ours, theirs = results[(label, "ours")], results[(label, "torch")]
        for impl, r in (("ours", ours), ("torch", theirs)):
            is_ours = impl == "ours"
            rows.append([
                label, "megastrategy PipelineExecutor" if is_ours else
                ("torch Schedule1F1B" if vp == 1 else "torch ScheduleInterleaved1F1B"),
                pp, r["step_ms"], common.fmt_num(common.ratio(ours["step_ms"], theirs["step_ms"])) if is_ours else "",
                r["cpu_ms"], common.fmt_num(common.ratio(ours["cpu_ms"], theirs["cpu_ms"])) if is_ours else "",
                lst(r["all_step_ms"]),
                lst(r["saved_mib"]), common.fmt_num(common.ratio(max(ours["saved_mib"]), max(theirs["saved_mib"])))
                if is_ours else "",
                lst(r["heap_mib"]), common.fmt_num(common.ratio(max(ours["heap_mib"]), max(theirs["heap_mib"])))
                if is_ours and None not in ours["heap_mib"] + theirs["heap_mib"] else "",
                lst(r["rss_mib"]), lst(r["in_flight"], 2), r["loss_rel_err"], r["grad_rel_err"],
            ])
    act = results[(CONFIGS[0][0], "ours")]["act_mib_per_mb"]
    report.table(
        f"1. Pipeline step (forward+backward of all M={m} microbatches, no optimizer), {LAYERS} MLP blocks h={HIDDEN} "
        f"FFN {FFN_MULT}h, microbatch {mb}x{seq} tokens, fp32",
        ["config", "implementation", "procs", "median step ms", "step ours/torch", "cpu ms/step", "cpu ours/torch",
         "all runs' medians ms",
         "saved act. peak MiB per rank", "saved ours/torch (max rank)", "heap peak delta MiB per rank",
         "heap ours/torch (max rank)", "RSS growth MiB per rank", "peak in-flight mb per rank",
         "loss rel. err vs serial", "grad-norm rel. err vs serial"],
        rows,
        notes=[
            "step ms: slowest rank, median over the measured steps (a barrier starts every step); each configuration "
            "ran --repeats times, ours and torch interleaved, and the run with the lowest median is shown. cpu ms/step: "
            "process CPU time (all threads) of the busiest rank in the same window, less sensitive to other load.",
            "saved act.: peak bytes of distinct storages autograd held for backward during one step "
            "(torch.autograd.graph.saved_tensors_hooks; parameters excluded) - the activation memory the schedule keeps "
            f"alive; one block's output for one microbatch is {act:.2f} MiB.",
            "heap peak delta: glibc mallinfo2 in-use bytes (all arenas + mmapped chunks, where CPU tensors live), "
            "sampled before/after every forward, loss and backward of one extra step, minus the value before the first "
            "(warm-up) step: everything held at once, including buffers a schedule allocates once and keeps "
            "(activations, outputs kept for backward, receive buffers, gradients).",
            "RSS growth: peak resident set size sampled at the same points minus the RSS before the first step "
            "(includes allocator caching; coarse).",
            "peak in-flight: ours = PipelineExecutor.peak_in_flight; torch = max entries in PipelineStage.fwd_cache.",
            "loss/grad: mean microbatch loss and global gradient norm of the last step vs the same model on one process.",
            f"{max(pp for _, pp, _ in CONFIGS)} processes on {os.cpu_count()} cores for pp=4: ranks time-share the "
            "CPUs, so step times there are inflated for both implementations alike.",
        ],
        raw={f"{k[0]}/{k[1]}": v for k, v in results.items()},
    )

    rows = []
    for label, pp, vp in CONFIGS:
        for impl in ("ours", "torch"):
            r = results[(label, impl)]
            rows.append([
                label, impl, lst(r["idle"]), r["idle_mean"], lst(r["sim_idle"]), r["sim_bubble"],
                common.fmt_num(common.ratio(r["idle_mean"], r["sim_bubble"])), lst(r["wait_ms"]),
                r["fwd_ms"], r["bwd_ms"], r["step_ms"], r["sim_makespan_ms"],
                common.fmt_num(common.ratio(r["step_ms"], r["sim_makespan_ms"])),
            ])
    report.table(
        "2. Idle fraction per rank: measured vs simulate_schedule(M, pp, vp, forward_time, backward_time)",
        ["config", "impl", "measured idle per rank", "measured mean", "simulated idle per rank", "simulated bubble",
         "measured / simulated", "p2p wait ms per rank", "fwd ms (per chunk step)", "bwd ms", "measured step ms",
         "simulated makespan ms", "step / makespan"],
        rows,
        notes=[
            "measured idle of a rank = (time blocked in p2p waits + time finished early while the slowest rank still ran) "
            "/ step time of the slowest rank, summed over the measured steps. Waits are timed by wrapping "
            "PipelineCommunicator._wait_works (ours) and torch.distributed.pipelining.schedules._wait_batch_p2p (torch).",
            "simulated: megastrategy.pipeline.simulate_schedule with forward_time / backward_time = the mean measured "
            "compute time of one forward (blocks + loss) / one backward (torch.autograd.backward) of one chunk on one "
            "microbatch, over all ranks; p2p_time = 0. The simulator models megastrategy's schedule order; torch's 1F1B "
            "has the same bubble in this model.",
            "the measured idle also contains the transfer time of every message (the simulator assumes free p2p) and, "
            "with more processes than cores, time a rank waited because its neighbour was descheduled.",
        ],
    )


def p2p_worker(rank: int, world: int, sizes: list[int], iters: int) -> dict:
    """Round trip of one tensor (rank 0 -> 1 -> 0): megastrategy's PipelineCommunicator
    (send_forward / recv_forward, then send_backward / recv_backward) vs plain gloo
    isend/irecv into a buffer of known size, as torch.distributed.pipelining posts them."""
    import torch.distributed as dist

    from megastrategy.pipeline.p2p import PipelineCommunicator

    comm = PipelineCommunicator(pp_group=dist.group.WORLD, pp_ranks=[0, 1], pp_rank=rank, device="cpu")
    out = {}
    for n in sizes:
        t = torch.randn(n // 4)
        times: dict[str, list[float]] = {"ours": [], "raw": []}
        for i in range(2 * iters + 4):
            mode = "ours" if i % 2 == 0 else "raw"
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "ours":
                comm.begin_step()  # a step: after the first, each tensor is one predicted message
                if rank == 0:
                    comm.send_forward(t, microbatch=i)
                    comm.recv_backward(expect_microbatch=i)
                else:
                    comm.send_backward(comm.recv_forward(expect_microbatch=i), microbatch=i)
                comm.wait_all()
            else:
                buf = torch.empty_like(t)
                if rank == 0:
                    works = [dist.isend(t, 1), dist.irecv(buf, 1)]
                else:
                    dist.irecv(buf, 0).wait()
                    works = [dist.isend(buf, 0)]
                for w in works:
                    w.wait()
            if i >= 4:
                times[mode].append(time.perf_counter() - t0)
        out[n] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return out


def section_p2p(report: common.Report, timeout: float) -> None:
    sizes = [4, 4 * 32 * HIDDEN * 4, 1 << 20]
    res = common.spawn(p2p_worker, 2, sizes, 40, timeout=timeout)[0]
    rows = [[common.fmt_num(n), res[n]["ours"], res[n]["raw"], common.ratio(res[n]["ours"], res[n]["raw"]),
             (res[n]["ours"] - res[n]["raw"]) / 2] for n in sizes]
    report.table(
        "3. p2p round trip between 2 processes (rank 0 -> rank 1 -> rank 0), median of 40",
        ["bytes", "PipelineCommunicator ms", "plain gloo isend/irecv ms", "ours / plain", "extra ms per message"],
        rows,
        notes=[
            "Each round trip is one communicator step (begin_step): after the first, PipelineCommunicator posts the "
            "receive at the predicted size and each tensor is one message, its payload followed by a 32-byte trailer "
            "(issue #16; before, a 16 x int64 header and then the payload, the payload receive posted only once the "
            f"header had arrived). {4 * 32 * HIDDEN * 4:,} B is one microbatch activation of section 1.",
            "torch.distributed.pipelining posts irecv into pre-allocated buffers of known shape (after its first step).",
        ],
        raw=res,
    )


def section_lightning(report: common.Report, steps: int, warmup: int, batch: int, micro: int, repeats: int,
                      timeout: float) -> None:
    base = {"steps": steps + warmup, "warmup": warmup, "batch_size": batch}
    runs = [
        ("plain Lightning (default strategy)", 1, {"strategy": "plain"}),
        (f"MegatronStrategy(pp=2, num_microbatches={micro})", 2, {"strategy": "megatron", "pp": 2,
                                                                "num_microbatches": micro}),
        (f"MegatronStrategy(pp=2, vp=2, num_microbatches={micro})", 2, {"strategy": "megatron", "pp": 2, "vp": 2,
                                                                      "num_microbatches": micro}),
    ]
    res = lightning_runs.run_lightning_set(runs, base, repeats, timeout)
    plain = res[runs[0][0]]
    rows = []
    for name, n, cfg in runs:
        r = res[name]
        rows.append([name, n, f"{batch} / {batch}", r["median_ms"], f"{common.fmt_num(r['p10_ms'])}-"
                     f"{common.fmt_num(r['p90_ms'])}", r["cpu_ms"], r["iteration_ms"],
                     common.ratio(r["median_ms"], plain["median_ms"]), lightning_runs.loss_gap(r["losses"], plain["losses"]),
                     ", ".join(common.fmt_num(v) for v in r["all_medians_ms"]),
                     f"{r['loadavg_before']} -> {r['loadavg_after']}"])
    cfg = lightning_runs.GPT_CFG
    report.table(
        f"4. Lightning training step, GPT example with MegatronStrategy(pp=2) (d_model={cfg['d_model']}, "
        f"{cfg['n_layer']} layers, seq={cfg['seq_len']}), median over {steps} steps after {warmup} warm-up",
        ["run", "procs", "batch per rank / global", "median step ms", "p10-p90 ms", "cpu ms/step",
         "median iteration ms", "step vs plain", "max rel. loss diff vs plain", "all medians ms",
         "load avg before -> after"],
        rows,
        notes=lightning_runs.LIGHTNING_NOTES + [
            f"pipeline rows: 2 processes on {os.cpu_count()} cores, each stage holding half the blocks; the step includes "
            "the schedule, the tied-embedding gradient all-reduce between first and last stage, and the broadcast of the "
            "logged values from the last stage. Context only: a 4-layer model with tiny microbatches is dominated by "
            "per-message and per-microbatch overhead.",
        ],
        raw={k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in res.items()},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=8, help="M for section 1-2 (default 8)")
    p.add_argument("--mb", type=int, default=4, help="sequences per microbatch (default 4)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--steps", type=int, default=6, help="measured pipeline steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured pipeline steps first")
    p.add_argument("--lightning-steps", type=int, default=20)
    p.add_argument("--lightning-warmup", type=int, default=5)
    p.add_argument("--lightning-microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch of the Lightning runs")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved (best median kept)")
    p.add_argument("--skip-schedules", action="store_true")
    p.add_argument("--skip-lightning", action="store_true")
    p.add_argument("--timeout", type=float, default=300, help="hard limit per launched job, seconds")
    p.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    config = {"model": {"layers": LAYERS, "hidden": HIDDEN, "ffn": FFN_MULT * HIDDEN, "block": "pre-LN MLP"},
              "microbatches": args.microbatches, "microbatch": [args.mb, args.seq], "steps": args.steps,
              "warmup": args.warmup, "configs": CONFIGS,
              "lightning": {**lightning_runs.GPT_CFG, "steps": args.lightning_steps, "warmup": args.lightning_warmup,
                            "global_batch": args.batch, "num_microbatches": args.lightning_microbatches,
                            "repeats": args.repeats}}
    report = common.Report("bench_pp", "megastrategy pipeline-parallel benchmark (bench/bench_pp.py)",
                           common.machine_info(), config)
    t0 = time.perf_counter()
    if not args.skip_schedules:
        section_schedules(report, args.microbatches, args.mb, args.seq, args.steps, args.warmup, args.repeats,
                          args.timeout)
        section_p2p(report, args.timeout)
    if not args.skip_lightning:
        section_lightning(report, args.lightning_steps, args.lightning_warmup, args.batch,
                          args.lightning_microbatches, args.repeats, args.timeout)
    js, md = report.save(args.out_dir)
    print(f"total {time.perf_counter() - t0:.0f}s; wrote {js} and {md}", flush=True)


if __name__ == "__main__":
    main()
