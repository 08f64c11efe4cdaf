"""Data parallelism (dp=2): Lightning's DDPStrategy vs MegatronStrategy's default overlapped reduction.

    OMP_NUM_THREADS=1 python bench/bench_dp.py                 # ~3 min on an idle 2-core machine
    python bench/bench_dp.py --repeats 3 --steps 30 --warmup 5

A 4-layer Hugging Face BERT classifier (hidden 256, 4 heads, FFN 1024, vocabulary 30,522, about
11M parameters) trains on fixed random tokens (per-rank batch 8, sequence 64, AdamW, fp32) on two
processes (gloo). Configurations, run interleaved (A B C D A B C D ...), each on fresh processes:

* ``ddp``: ``DDPStrategy()`` (DistributedDataParallel, 25 MB buckets all-reduced during backward);
* ``ours default``: ``MegatronStrategy()``: overlap_grad_reduce=None resolves to on; with the
  default ``bucket_numel`` (40M elements) the whole model is one bucket, so the "overlap" starts
  the one all-reduce when the backward ends;
* ``ours overlap off``: ``MegatronStrategy(overlap_grad_reduce=False)``;
* ``ours default, 1M buckets``: ``bucket_numel=1_000_000``: the layers' buckets reduce while the
  backward computes the earlier layers (what overlap can buy).

Reported per configuration: the median step (on_train_batch_start -> end, slowest rank), the
median CPU time per rank in that window (process_time: all threads, insensitive to time spent
descheduled by other load), and both as ratios to DDP; the load average before each run. Results
go to bench/results/bench_dp.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bert_bench import bert_classifier, cpu_ms_per_rank, read_ranks, slowest_median_ms, step_timer, timer_record  # noqa: E402
from common import RESULTS, launch_script, load_average, machine_info, machine_line, md_table, text_table  # noqa: E402

CONFIGS = {
    "ddp": {"strategy": "ddp"},
    "ours default": {"strategy": "megatron"},
    "ours overlap off": {"strategy": "megatron", "overlap_grad_reduce": False},
    "ours default, 1M buckets": {"strategy": "megatron", "bucket_numel": 1_000_000},
}


def worker(cfg: dict) -> None:
    """One rank of one run: train, write this rank's step and CPU times to cfg['out'].rankR.json."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    class Bert(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = bert_classifier(hidden=256, layers=4, vocab=30522)

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return self.model(input_ids=ids, labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own half of the global batch
    n = cfg["batch"] * (cfg["steps"] + 1)
    data = TensorDataset(torch.randint(0, 30522, (n, cfg["seq"]), generator=g), torch.randint(0, 2, (n,), generator=g))
    if cfg["strategy"] == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy()
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(**{k: v for k, v in cfg.items() if k in ("overlap_grad_reduce", "bucket_numel")})
    timer = step_timer()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer], use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(Bert(), DataLoader(data, batch_size=cfg["batch"], shuffle=False))
    Path(f"{cfg['out']}.rank{rank}.json").write_text(json.dumps(timer_record(timer)))


def run(cfg: dict, timeout: float) -> dict:
    """One launch on 2 processes; medians after the warm-up steps (slowest rank's step, each rank's CPU)."""
    out = Path(tempfile.mkdtemp(prefix="bench-dp-")) / "run"
    load = load_average()
    launch_script(Path(__file__).resolve(), 2, ["--worker", json.dumps({**cfg, "out": str(out)})], timeout)
    ranks, w = read_ranks(out, 2), cfg["warmup"]
    return {"median_ms": slowest_median_ms(ranks, "step", w),
            "cpu_ms_per_rank": cpu_ms_per_rank(ranks, w),
            "loss": [sum(v) / 2 for v in zip(*(r["loss"] for r in ranks))], "load_before": load}


def summarize(runs: dict[str, list[dict]]) -> tuple[list[str], list[list]]:
    """One row per configuration: medians over the repeats, and ratios to DDP's."""
    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    def cpu(name):
        return statistics.median(max(r["cpu_ms_per_rank"]) for r in runs[name])

    ddp_step, ddp_cpu = med("ddp", "median_ms"), cpu("ddp")
    rows = []
    for name, rs in runs.items():
        step = med(name, "median_ms")
        gap = max(abs(a - b) for a, b in zip(rs[0]["loss"], runs["ddp"][0]["loss"]))
        rows.append([name, f"{step:.1f}", f"{step / ddp_step:.2f}x", f"{cpu(name):.1f}", f"{cpu(name) / ddp_cpu:.2f}x",
                     " ".join(f"{r['median_ms']:.0f}" for r in rs), f"{gap:.1e}"])
    headers = ["dp=2", "median step (ms)", "step vs DDP", "CPU/rank (ms)", "CPU vs DDP", "each repeat (ms)",
               "max loss gap vs DDP"]
    return headers, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    info = machine_info()
    base = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq": args.seq}
    names = ["ddp"] + [n for n in args.configs if n != "ddp"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            r = run({**base, **CONFIGS[name]}, args.timeout)
            runs[name].append(r)
            print(f"  [{name} {rep + 1}/{args.repeats}: median step {r['median_ms']:.1f} ms, CPU/rank "
                  f"{', '.join(f'{c:.1f}' for c in r['cpu_ms_per_rank'])} ms, load {r['load_before']}]", flush=True)
    headers, rows = summarize(runs)
    print(machine_line(info))
    print(text_table(headers, rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_dp.json").write_text(json.dumps({"machine": info, "args": vars(args), "runs": runs}))
    (RESULTS / "bench_dp.md").write_text(f"{machine_line(info)}\n\n{md_table(headers, rows)}\n")


if __name__ == "__main__":
    main()
