"""What running the user's whole step on every pipeline stage costs (the model-output relay).

    OMP_NUM_THREADS=1 python bench/bench_output_relay.py --before 270c80f   # this tree vs a commit
    python bench/bench_output_relay.py --steps 20 --repeats 2                # bytes and times, this tree only

For examples/pretrain_gpt.py's GPT (its tied LM head returns the logits, batch x seq x vocab) and a
Hugging Face BertForSequenceClassification (returns loss and batch x labels logits), trained with
MegatronStrategy(pp=2) in Lightning on 2 processes: the bytes the relay moves per training step
(read on the receiving stage) and the median step time. With ``--before REF`` the same GPT run is
repeated with the source tree of git commit REF (``git archive``), interleaved with this tree's runs
(A B A B ...), and the ratio of the best medians is printed. Results go to bench/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS, launch_script, machine_info, machine_line, md_table, text_table  # noqa: E402

import torch  # noqa: E402

GPT_CFG = {"d_model": 128, "n_head": 4, "n_layer": 4, "seq_len": 64, "lr": 1e-3}


def _bert_module():
    import lightning as L
    from transformers import AutoModelForSequenceClassification, BertConfig

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_size=512, max_position_embeddings=64, num_labels=2)
            self.model = AutoModelForSequenceClassification.from_config(config)

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return self.model(input_ids=ids % 1000, labels=labels[:, 0] % 2).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Classifier()


def worker(cfg: dict) -> None:
    """One rank of one run; writes its step times and relay bytes to cfg['out'].rankR.json."""
    if cfg.get("src"):
        sys.path.insert(0, cfg["src"])  # the tree under comparison, ahead of this one
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    import megastrategy
    from megastrategy import MegatronStrategy
    from pretrain_gpt import BUILTIN_CORPUS, GPT, CharCorpus

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    class Timer(Callback):
        def __init__(self):
            self.step, self.cpu, self.bytes = [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.step.append(time.perf_counter() - self._t0)
            self.cpu.append(time.process_time() - self._c0)
            relay = getattr(trainer.strategy._runner, "relay", None)
            self.bytes.append(getattr(relay, "last_bytes", 0))

    L.seed_everything(0, verbose=False)
    text = BUILTIN_CORPUS * 4
    vocab = sorted(set(text))
    data = CharCorpus(text, GPT_CFG["seq_len"], vocab)
    if cfg["model"] == "gpt":
        model = GPT(len(vocab), GPT_CFG["seq_len"], GPT_CFG["d_model"], GPT_CFG["n_head"], GPT_CFG["n_layer"], GPT_CFG["lr"])
    else:
        model = _bert_module()
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=MegatronStrategy(pp=2), max_steps=cfg["steps"], limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer], use_distributed_sampler=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=cfg["batch_size"], shuffle=False))
    Path(f"{cfg['out']}.rank{rank}.json").write_text(json.dumps(
        {"step": timer.step, "cpu": timer.cpu, "bytes": timer.bytes, "src": str(Path(megastrategy.__file__).parents[1]), "vocab": len(vocab)}))


def run(cfg: dict, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="megabench-relay-")) / "run"
    cfg = dict(cfg, out=str(out))
    launch_script(Path(__file__).resolve(), 2, ["--worker", json.dumps(cfg)], timeout)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    w = cfg["warmup"]
    return {
        "median_ms": max(statistics.median(r["step"][w:]) for r in ranks) * 1e3,
        "cpu_ms": max(statistics.median(r["cpu"][w:]) for r in ranks) * 1e3,
        "bytes_per_step": ranks[0]["bytes"][-1],  # rank 0 receives
        "src": ranks[0]["src"], "vocab": ranks[0]["vocab"],
    }


def _checkout(ref: str) -> str:
    """``src/`` of git commit ``ref`` in a temporary directory."""
    target = Path(tempfile.mkdtemp(prefix="megabench-before-"))
    archive = subprocess.run(["git", "archive", ref, "src"], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return str(target / "src")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--before", help="git commit to compare the GPT step time with (e.g. the commit before the relay)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    base = {"steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size}
    variants = {"after": None, **({"before": _checkout(args.before)} if args.before else {})}
    best: dict[str, dict] = {}
    for rep in range(args.repeats):
        for name, src in variants.items():
            r = run({**base, "model": "gpt", "src": src}, args.timeout)
            print(f"  [gpt {name} run {rep + 1}: median step {r['median_ms']:.1f} ms, cpu {r['cpu_ms']:.1f} ms]", flush=True)
            if name not in best or r["median_ms"] < best[name]["median_ms"]:
                best[name] = dict(r, cpu_ms=min(r["cpu_ms"], best.get(name, r)["cpu_ms"]))
            else:
                best[name]["cpu_ms"] = min(best[name]["cpu_ms"], r["cpu_ms"])
    bert = run({**base, "model": "bert", "src": None}, args.timeout)
    after, before = best["after"], best.get("before")
    rows = [["GPT example (pp=2, logits)", after["bytes_per_step"], f"{after['median_ms']:.1f}",
             f"{before['median_ms']:.1f}" if before else "-",
             f"{after['median_ms'] / before['median_ms']:.3f}" if before else "-",
             f"{after['cpu_ms']:.1f} / {before['cpu_ms']:.1f} = {after['cpu_ms'] / before['cpu_ms']:.3f}" if before else "-"],
            ["BERT classifier (pp=2, loss+logits)", bert["bytes_per_step"], f"{bert['median_ms']:.1f}", "-", "-", "-"]]
    headers = ["model", "relay bytes/step", "step ms (after)", "step ms (before)", "after/before",
               "cpu ms after / before (slowest rank, best run)"]
    info = machine_info()
    print(machine_line(info))
    print(f"batch {args.batch_size}, GPT vocab {best['after']['vocab']}, seq {GPT_CFG['seq_len']}, d_model {GPT_CFG['d_model']}; "
          f"best of {args.repeats} interleaved runs, median of steps after {args.warmup} warm-up steps")
    print(text_table(headers, rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_output_relay.json").write_text(json.dumps({"machine": info, "gpt": best, "bert": bert}, indent=1))
    (RESULTS / "bench_output_relay.md").write_text(machine_line(info) + "\n\n" + md_table(headers, rows) + "\n")


if __name__ == "__main__":
    main()
