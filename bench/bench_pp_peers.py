"""A pipelined Hugging Face BERT under Lightning + MegatronStrategy(pp) beside torch.distributed.pipelining.

    OMP_NUM_THREADS=1 python bench/bench_pp_peers.py                  # pp=2 and pp=4, h256 and h64
    python bench/bench_pp_peers.py --pp 2 --hidden 64 --repeats 2     # one case

What a user would pick instead of this project for pipeline parallelism is torch's own
``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``) in a plain training loop. Both
sides train the same ``BertForSequenceClassification`` (8 layers, built by ``from_config`` from the same
seed, loss computed inside with ``labels=``; torch's side cuts the same modules into stages by hand), on
the same batches (16 sequences of 64 tokens, 4 microbatches), with AdamW, on the same processes (gloo,
one thread each). Per case: the median training step time of each side (``ours``: Lightning's
``on_train_batch_start`` to ``on_train_batch_end``, i.e. forward, backward and optimizer step; ``torch``:
the same three in its loop), their ratio, the forward-only step (Lightning's ``validate`` beside
torch's ``schedule.eval``), and the largest difference between the two sides' per-step training
losses. Runs are interleaved (ours, torch, ours, torch...) and the best median of each side is kept.

A plain loop does not pay for Lightning's own loop (hooks, closures, logging, progress tracking). The
last table measures that part alone on one process: the same model unpipelined under plain Lightning
(``Trainer(devices=1)``) beside the same model in a plain loop, so its difference can be set against the
pipelined ratio. Results go to bench/results/bench_pp_peers.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bert_bench import bert_classifier, cpu_ms_per_rank, read_ranks, slowest_median_ms, step_timer, timer_record, token_batches  # noqa: E402
from common import RESULTS, launch_script, load_average, machine_info, machine_line, md_table, text_table  # noqa: E402

import torch  # noqa: E402

LAYERS, SEQ, BATCH, MICROBATCHES, VOCAB, LR = 8, 64, 16, 4, 1000, 1e-3


def _bert(hidden: int):
    return bert_classifier(hidden, LAYERS, VOCAB, SEQ)


def _batches(steps: int) -> torch.utils.data.DataLoader:
    return token_batches(steps, BATCH, SEQ, VOCAB)


class _Stage(torch.nn.Module):
    """Stage ``rank`` of ``pp`` of a BertForSequenceClassification, cut by hand for torch's pipelining."""

    def __init__(self, model, rank: int, pp: int) -> None:
        super().__init__()
        per = LAYERS // pp
        self.first, self.last = rank == 0, rank == pp - 1
        self.embeddings = model.bert.embeddings if self.first else None
        self.layers = torch.nn.ModuleList(model.bert.encoder.layer[rank * per:(rank + 1) * per])
        self.pooler = model.bert.pooler if self.last else None
        self.classifier = model.classifier if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(input_ids=x) if self.first else x
        for layer in self.layers:
            h = layer(h)
        return self.classifier(self.pooler(h)) if self.last else h


def bert_lightning_module(hidden: int):
    """The LightningModule a user writes around the BERT classifier (loss from ``labels=``)."""
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _bert(hidden)

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return self.model(input_ids=ids, labels=labels).loss

        validation_step = training_step

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return Classifier()


def lightning_run(hidden: int, pp: int, steps: int, callbacks: list, stages: tuple[str, ...] = ("fit", "validate")) -> None:
    """``trainer.fit`` and/or ``trainer.validate`` of :func:`bert_lightning_module` under
    ``MegatronStrategy(pp)`` (plain Lightning on one process when ``pp`` is 1)."""
    import lightning as L

    if pp > 1:
        from megastrategy import MegatronStrategy

        strategy, devices = MegatronStrategy(pp=pp, num_microbatches=MICROBATCHES), pp
    else:
        strategy, devices = "auto", 1
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=callbacks, use_distributed_sampler=False)
    module = bert_lightning_module(hidden)
    if "fit" in stages:
        trainer.fit(module, _batches(steps))
    if "validate" in stages:
        trainer.validate(module, _batches(steps), verbose=False)


def step_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The command line of the scripts that time or profile one pipelined step of this BERT."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--stage", choices=["training", "validation"], default="training")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    return p


def _lightning_worker(cfg: dict, rank: int) -> dict:
    timer = step_timer()
    lightning_run(cfg["hidden"], cfg["pp"], cfg["steps"], [timer])
    return timer_record(timer)


def _torch_worker(cfg: dict, rank: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    model, pp = _bert(cfg["hidden"]), cfg["pp"]
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        dist.init_process_group("gloo")
        module = _Stage(model, rank, pp)
        stage = PipelineStage(module, rank, pp, torch.device("cpu"))
        schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=F.cross_entropy)
    else:
        module = model
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    times, cpu, losses = [], [], []
    for ids, labels in _batches(cfg["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        if pp > 1:
            out: list = []
            schedule.step(*((ids,) if rank == 0 else ()), target=labels if rank == pp - 1 else None,
                          losses=out if rank == pp - 1 else None)
            loss = sum(float(v) for v in out) / MICROBATCHES if out else float("nan")
        else:
            output = module(input_ids=ids, labels=labels)
            output.loss.backward()
            loss = float(output.loss)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss)
    val = _torch_validation(schedule if pp > 1 else module, rank, pp, cfg["steps"])
    if pp > 1:
        dist.destroy_process_group()
    return {"step": times, "cpu": cpu, "loss": losses, "val": val}


def _torch_validation(runner, rank: int, pp: int, steps: int) -> list[float]:
    """Forward-only steps: ``schedule.eval`` (pipelined) or the module under ``no_grad``."""
    times = []
    with torch.no_grad():
        for ids, labels in _batches(steps):
            t0 = time.perf_counter()
            if pp > 1:
                runner.eval(*((ids,) if rank == 0 else ()), target=labels if rank == pp - 1 else None,
                            losses=[] if rank == pp - 1 else None)
            else:
                runner(input_ids=ids, labels=labels)
            times.append(time.perf_counter() - t0)
    return times


def worker(cfg: dict) -> None:
    import os

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    result = (_lightning_worker if cfg["side"] == "ours" else _torch_worker)(cfg, rank)
    Path(f"{cfg['out']}.rank{rank}.json").write_text(json.dumps(result))


def run(cfg: dict, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="megabench-peers-")) / "run"
    cfg = dict(cfg, out=str(out))
    launch_script(Path(__file__).resolve(), cfg["pp"], ["--worker", json.dumps(cfg)], timeout)
    ranks, w = read_ranks(out, cfg["pp"]), cfg["warmup"]
    return {"median_ms": slowest_median_ms(ranks, "step", w), "val_ms": slowest_median_ms(ranks, "val", w),
            "cpu_ms": cpu_ms_per_rank(ranks, w), "loss": ranks[-1]["loss"]}


def _best_of(cfg: dict, sides: tuple[str, str], repeats: int, timeout: float) -> dict[str, dict]:
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for side in sides:
            r = run(dict(cfg, side=side), timeout)
            cpu = ", ".join(f"{c:.1f}" for c in r["cpu_ms"])
            print(f"  [{side} pp={cfg['pp']} h{cfg['hidden']}: median step {r['median_ms']:.1f} ms, cpu per rank {cpu} ms, "
                  f"validation step {r['val_ms']:.1f} ms]",
                  flush=True)
            if side not in best or r["median_ms"] < best[side]["median_ms"]:
                best[side] = r
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 64])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--skip-loop", action="store_true", help="skip the one-process Lightning-vs-plain-loop table")
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    base = {"steps": args.steps, "warmup": args.warmup}
    rows, raw = [], {}
    for pp in args.pp:
        for hidden in args.hidden:
            best = _best_of(dict(base, pp=pp, hidden=hidden), ("ours", "torch"), args.repeats, args.timeout)
            ours, theirs = best["ours"], best["torch"]
            gap = max(abs(a - b) for a, b in zip(ours["loss"], theirs["loss"]))
            rows.append([f"pp={pp}, h{hidden}", f"{ours['median_ms']:.1f}", f"{theirs['median_ms']:.1f}",
                         f"{ours['median_ms'] / theirs['median_ms']:.2f}x",
                         f"{ours['val_ms']:.1f} / {theirs['val_ms']:.1f} = {ours['val_ms'] / theirs['val_ms']:.2f}x",
                         f"{max(ours['cpu_ms']):.1f} / {max(theirs['cpu_ms']):.1f}", f"{gap:.1e}"])
            raw[f"pp{pp}_h{hidden}"] = best
    loop_rows = []
    for hidden in [] if args.skip_loop else args.hidden:
        best = _best_of(dict(base, pp=1, hidden=hidden), ("ours", "torch"), args.repeats, args.timeout)
        lightning, plain = best["ours"]["median_ms"], best["torch"]["median_ms"]
        loop_rows.append([f"h{hidden}, 1 process", f"{lightning:.1f}", f"{plain:.1f}", f"{lightning - plain:+.1f}"])
        raw[f"loop_h{hidden}"] = best
    info = machine_info()
    head = [machine_line(info), f"load before: {load_average()}",
            f"BertForSequenceClassification, {LAYERS} layers, batch {BATCH} x seq {SEQ}, {MICROBATCHES} microbatches, "
            f"best of {args.repeats} interleaved runs, median of {args.steps - args.warmup} steps after {args.warmup}"]
    headers = ["layout", "ours: Lightning + MegatronStrategy (ms)", "torch Schedule1F1B, plain loop (ms)",
               "ours / torch", "forward-only (validation) ms: ours / torch", "CPU ms per step, busiest rank: ours / torch", "max loss diff"]
    loop_headers = ["Lightning's own loop", "plain Lightning (ms)", "plain loop (ms)", "Lightning's cost (ms)"]
    print("\n".join(head))
    print(text_table(headers, rows))
    print(text_table(loop_headers, loop_rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_pp_peers.json").write_text(json.dumps({"machine": info, "runs": raw}, indent=1))
    (RESULTS / "bench_pp_peers.md").write_text("\n\n".join(head + [md_table(headers, rows), md_table(loop_headers, loop_rows)]) + "\n")


if __name__ == "__main__":
    main()
