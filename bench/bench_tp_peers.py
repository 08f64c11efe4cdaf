"""Tensor parallelism of a Hugging Face BERT: MegatronStrategy(tp=2) beside Lightning's ModelParallelStrategy.

    OMP_NUM_THREADS=1 python bench/bench_tp_peers.py                 # tp=2, 4-layer BERT h256
    python bench/bench_tp_peers.py --hidden 64 --repeats 3

What a Lightning user would pick instead of this project for tensor parallelism is Lightning's own
``ModelParallelStrategy`` with a plan they write: ``configure_model`` calls torch's
``parallelize_module`` on every ``BertLayer`` (Q/K/V and the FFN's first linear column-wise, the two
output projections row-wise, the rest replicated), as Lightning's TP tutorial does. Ours is the same
``LightningModule`` unchanged under ``MegatronStrategy(tp=2)``. Both train the same
``BertForSequenceClassification`` (``from_config``, same seed, loss computed inside with ``labels=``)
on the same batches with AdamW on 2 processes (gloo, one thread each). Per side: the median training
step (``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, optimizer step), CPU time
per rank, and the largest per-step loss difference. Runs are interleaved (ours, theirs, ...) and the
best median of each side is kept. Results go to bench/results/bench_tp_peers.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bert_bench import bert_classifier, cpu_ms_per_rank, read_ranks, slowest_median_ms, step_timer, timer_record, token_batches  # noqa: E402
from common import RESULTS, launch_script, load_average, machine_info, machine_line, md_table, text_table  # noqa: E402

import torch  # noqa: E402

LAYERS, SEQ, BATCH, VOCAB, LR = 4, 64, 16, 1000, 1e-3


def _user_tp_plan(model, mesh) -> None:
    """The plan a user writes for ModelParallelStrategy (Lightning's TP tutorial, applied to BertLayer)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attention.self.query": ColwiseParallel(), "attention.self.key": ColwiseParallel(),
            "attention.self.value": ColwiseParallel(), "attention.output.dense": RowwiseParallel(),
            "intermediate.dense": ColwiseParallel(), "output.dense": RowwiseParallel()}
    for layer in model.bert.encoder.layer:
        parallelize_module(layer, mesh, plan)


def _worker(cfg: dict) -> dict:
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = bert_classifier(cfg["hidden"], LAYERS, VOCAB, SEQ)

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return self.model(input_ids=ids, labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class UserPlannedClassifier(Classifier):
        def configure_model(self):
            _user_tp_plan(self.model, self.device_mesh["tensor_parallel"])

    timer = step_timer()
    if cfg["side"] == "ours":
        from megastrategy import MegatronStrategy

        strategy, module = MegatronStrategy(tp=cfg["tp"]), Classifier()
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=cfg["tp"])
        module = UserPlannedClassifier()
    trainer = L.Trainer(accelerator="cpu", devices=cfg["tp"], strategy=strategy, max_steps=cfg["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[timer], use_distributed_sampler=False)
    trainer.fit(module, token_batches(cfg["steps"], BATCH, SEQ, VOCAB))
    return timer_record(timer)


def worker(cfg: dict) -> None:
    import os

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    Path(f"{cfg['out']}.rank{rank}.json").write_text(json.dumps(_worker(cfg)))


def run(cfg: dict, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="megabench-tp-peers-")) / "run"
    cfg = dict(cfg, out=str(out))
    launch_script(Path(__file__).resolve(), cfg["tp"], ["--worker", json.dumps(cfg)], timeout)
    ranks, w = read_ranks(out, cfg["tp"]), cfg["warmup"]
    return {"median_ms": slowest_median_ms(ranks, "step", w), "cpu_ms": cpu_ms_per_rank(ranks, w), "loss": ranks[0]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, nargs="+", default=[256])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    rows, raw = [], {}
    for hidden in args.hidden:
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for side in ("ours", "theirs"):
                r = run({"side": side, "tp": args.tp, "hidden": hidden, "steps": args.steps, "warmup": args.warmup},
                        args.timeout)
                print(f"  [{side} tp={args.tp} h{hidden}: median step {r['median_ms']:.1f} ms, cpu per rank "
                      f"{', '.join(f'{c:.1f}' for c in r['cpu_ms'])} ms]", flush=True)
                if side not in best or r["median_ms"] < best[side]["median_ms"]:
                    best[side] = r
        ours, theirs = best["ours"], best["theirs"]
        gap = max(abs(a - b) for a, b in zip(ours["loss"], theirs["loss"]))
        rows.append([f"tp={args.tp}, h{hidden}", f"{ours['median_ms']:.1f}", f"{theirs['median_ms']:.1f}",
                     f"{ours['median_ms'] / theirs['median_ms']:.2f}x", f"{max(ours['cpu_ms']):.1f} / {max(theirs['cpu_ms']):.1f}",
                     f"{gap:.1e}"])
        raw[f"tp{args.tp}_h{hidden}"] = best
    info = machine_info()
    head = [machine_line(info), f"load after: {load_average()}",
            f"BertForSequenceClassification, {LAYERS} layers, batch {BATCH} x seq {SEQ}, AdamW, best of {args.repeats} "
            f"interleaved runs, median of {args.steps - args.warmup} steps after {args.warmup}"]
    headers = ["layout", "ours: MegatronStrategy (ms)", "Lightning ModelParallelStrategy + user plan (ms)",
               "ours / theirs", "CPU ms per step, busiest rank: ours / theirs", "max loss diff"]
    print("\n".join(head))
    print(text_table(headers, rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_tp_peers.json").write_text(json.dumps({"machine": info, "runs": raw}, indent=1))
    (RESULTS / "bench_tp_peers.md").write_text("\n\n".join(head + [md_table(headers, rows)]) + "\n")


if __name__ == "__main__":
    main()
