"""Where the time of one pipelined training step goes, ours beside torch's, part by part.

    OMP_NUM_THREADS=1 python bench/pp_step_breakdown.py                 # pp=2, h64, training
    python bench/pp_step_breakdown.py --hidden 256 --stage validation

bench_pp_peers.py says *how much* slower or faster a pipelined step is than the same model under
``torch.distributed.pipelining``'s ``Schedule1F1B`` in a plain loop; this script says *where*. Both
sides run bench_pp_peers.py's BERT on the same batches; timers wrapped around a few functions of
each side split every measured step into disjoint parts (a part's time excludes the parts nested
in it, so the parts add up to the step):

* ours: the user's step up to the stage cut (forward compute on this rank, the step's thread
  hand-over included), backward compute, waiting for a receive, posting sends and receives, the
  output relay and the paused steps' resumption after the schedule, the optimizer, and the rest
  (Lightning's loop, the strategy's per-step work);
* torch: ``forward_one_chunk``, ``backward_one_chunk``, waiting for p2p (``_wait_batch_p2p``),
  posting (``_batch_p2p``), the optimizer, and the rest of its loop.

Each part is shown as wall and CPU time (``thread_time`` of the thread that runs it; on a stage
before the last the user's step runs on a worker thread, whose CPU counts as forward, its small
tail after the relay included) per step and rank: the mean over the steps after ``--warmup`` (a mean, so the parts add up
to the step). Results go to bench/results/pp_step_breakdown.{json,md}.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pp_peers as peers  # noqa: E402
from common import RESULTS, launch_script, load_average, machine_info, machine_line, md_table, text_table  # noqa: E402

import torch  # noqa: E402


class PartTimers:
    """Exclusive wall and CPU time per part: nested parts are subtracted from the part around them."""

    def __init__(self) -> None:
        self.on = False
        self.wall: dict[str, float] = collections.defaultdict(float)
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def wrap(self, owner: object, name: str, part: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            if not timers.on:
                return original(*args, **kwargs)
            stack = timers._stack()
            frame = [time.perf_counter(), time.thread_time(), 0.0, 0.0]  # start wall, start cpu, inner wall, inner cpu
            stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                stack.pop()
                wall, cpu = time.perf_counter() - frame[0], time.thread_time() - frame[1]
                timers.wall[part] += wall - frame[2]
                timers.cpu[part] += cpu - frame[3]
                if stack:
                    stack[-1][2] += wall
                    stack[-1][3] += cpu

        setattr(owner, name, timed)

    def add_thread_cpu(self, owner: object, name: str, part: str) -> None:
        """CPU only (its wall overlaps the caller's wait): ``name`` runs on a worker thread."""
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                if timers.on:
                    timers.cpu[part] += time.thread_time() - start

        setattr(owner, name, timed)


def _ours(cfg: dict, timers: PartTimers) -> int:
    import lightning as L

    from megastrategy.pipeline import executor, p2p, step_runner, suspended_step

    for owner, name, part in (
        (L.LightningModule, "optimizer_step", "optimizer step (ours: with Lightning's closure and hooks)"),
        (step_runner.StepRunner, "run", "strategy: the step's set-up and logs"),
        (executor._ScheduleRun, "forward", "forward (the user's step to the stage cut)"),
        (executor._ScheduleRun, "backward", "backward"),
        (p2p.RecvHandle, "wait", "waiting for a receive"),
        (executor._ScheduleRun, "send", "posting sends and receives"),
        (executor._ScheduleRun, "post_until", "posting sends and receives"),
        (step_runner.StepRunner, "_finish_steps", "after the schedule: output relay, paused steps resumed"),
    ):
        timers.wrap(owner, name, part)
    # a stage before the last runs the user's step on a worker thread, paused at the model call
    timers.add_thread_cpu(suspended_step.SuspendedStep, "_run", "forward (the user's step to the stage cut)")
    cb = _step_callback(timers, cfg)

    stage = "fit" if cfg["stage"] == "training" else "validate"
    peers.lightning_run(cfg["hidden"], cfg["pp"], cfg["steps"], [cb], stages=(stage,))
    return cb.measured


def _step_callback(timers: PartTimers, cfg: dict):
    import lightning as L

    class Steps(L.Callback):
        """Times each step after the warm-up as the outermost part ("the rest")."""

        def __init__(self) -> None:
            self.seen = self.measured = 0

        def start(self) -> None:
            self.seen += 1
            if self.seen > cfg["warmup"]:
                timers.on = True
                timers._stack().append([time.perf_counter(), time.thread_time(), 0.0, 0.0])

        def end(self) -> None:
            if timers.on:
                frame = timers._stack().pop()
                timers.wall[REST] += time.perf_counter() - frame[0] - frame[2]
                timers.cpu[REST] += time.thread_time() - frame[1] - frame[3]
                timers.on = False
                self.measured += 1

        def on_train_batch_start(self, *args, **kwargs):
            self.start()

        def on_train_batch_end(self, *args, **kwargs):
            self.end()

        def on_validation_batch_start(self, *args, **kwargs):
            self.start()

        def on_validation_batch_end(self, *args, **kwargs):
            self.end()

    return Steps()


REST = "the rest of the step"


def _torch(cfg: dict, timers: PartTimers, rank: int) -> int:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.pipelining import schedules, stage as stage_mod

    for owner, name, part in (
        (torch.optim.AdamW, "step", "optimizer step (ours: with Lightning's closure and hooks)"),
        (stage_mod._PipelineStageBase, "forward_one_chunk", "forward (the user's step to the stage cut)"),
        (stage_mod._PipelineStageBase, "backward_one_chunk", "backward"),
        (schedules, "_wait_batch_p2p", "waiting for a receive"),
        (schedules, "_batch_p2p", "posting sends and receives"),
    ):
        timers.wrap(owner, name, part)
    pp = cfg["pp"]
    dist.init_process_group("gloo")
    module = peers._Stage(peers._bert(cfg["hidden"]), rank, pp)
    schedule = Schedule1F1B(PipelineStage(module, rank, pp, torch.device("cpu")), peers.MICROBATCHES,
                            loss_fn=F.cross_entropy)
    opt = torch.optim.AdamW(module.parameters(), lr=peers.LR)
    measured = 0
    with torch.set_grad_enabled(cfg["stage"] == "training"):
        for i, (ids, labels) in enumerate(peers._batches(cfg["steps"])):
            timers.on = i >= cfg["warmup"]
            frame = [time.perf_counter(), time.thread_time(), 0.0, 0.0]
            timers._stack().append(frame)
            args, target = ((ids,) if rank == 0 else ()), (labels if rank == pp - 1 else None)
            if cfg["stage"] == "training":
                opt.zero_grad()
                schedule.step(*args, target=target, losses=[] if rank == pp - 1 else None)
                opt.step()
            else:
                schedule.eval(*args, target=target, losses=[] if rank == pp - 1 else None)
            timers._stack().pop()
            if timers.on:
                timers.wall[REST] += time.perf_counter() - frame[0] - frame[2]
                timers.cpu[REST] += time.thread_time() - frame[1] - frame[3]
                measured += 1
    timers.on = False
    dist.destroy_process_group()
    return measured


def worker(cfg: dict) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    timers = PartTimers()
    steps = _ours(cfg, timers) if cfg["side"] == "ours" else _torch(cfg, timers, rank)
    steps = max(steps, 1)
    result = {"wall": {k: v / steps * 1e3 for k, v in timers.wall.items()},
              "cpu": {k: v / steps * 1e3 for k, v in timers.cpu.items()}}
    Path(f"{cfg['out']}.rank{rank}.json").write_text(json.dumps(result))


def _run(cfg: dict, timeout: float) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="megabreakdown-")) / "run"
    cfg = dict(cfg, out=str(out))
    launch_script(Path(__file__).resolve(), cfg["pp"], ["--worker", json.dumps(cfg)], timeout)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(cfg["pp"])]


PARTS = ("forward (the user's step to the stage cut)", "backward", "waiting for a receive", "posting sends and receives",
         "after the schedule: output relay, paused steps resumed", "strategy: the step's set-up and logs",
         "optimizer step (ours: with Lightning's closure and hooks)", REST)


def _table(ours: list[dict], theirs: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["part (ms per step)"] + [f"rank {r}: ours / torch wall (CPU)" for r in range(len(ours))]
    rows = []
    for part in PARTS + ("total",):
        row = [part]
        for o, t in zip(ours, theirs):
            get = lambda side, kind: sum(side[kind].values()) if part == "total" else side[kind].get(part, 0.0)  # noqa: E731
            row.append(f"{get(o, 'wall'):.1f} / {get(t, 'wall'):.1f} ({get(o, 'cpu'):.1f} / {get(t, 'cpu'):.1f})")
        rows.append(row)
    return headers, rows


def main() -> None:
    args = peers.step_parser(__doc__, steps=30).parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    cfg = {k: getattr(args, k) for k in ("pp", "hidden", "stage", "steps", "warmup")}
    ours, theirs = _run(dict(cfg, side="ours"), args.timeout), _run(dict(cfg, side="torch"), args.timeout)
    headers, rows = _table(ours, theirs)
    head = [machine_line(machine_info()), f"load before: {load_average()}",
            f"{args.stage} step, BertForSequenceClassification {peers.LAYERS} layers h{args.hidden}, pp={args.pp}, "
            f"{peers.MICROBATCHES} microbatches, mean of {args.steps - args.warmup} steps after {args.warmup}; "
            "ours: Lightning + MegatronStrategy, torch: Schedule1F1B in a plain loop"]
    print("\n".join(head))
    print(text_table(headers, rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pp_step_breakdown.json").write_text(json.dumps({"config": cfg, "ours": ours, "torch": theirs}, indent=1))
    (RESULTS / "pp_step_breakdown.md").write_text("\n\n".join(head + [md_table(headers, rows)]) + "\n")


if __name__ == "__main__":
    main()
