"""Lightning step-time runs of the GPT example (``examples/pretrain_gpt.py``), shared by
``bench_tp.py`` and ``bench_pp.py``: each run is launched as this script with
``--lightning-worker`` on fresh processes, so that every strategy starts from a clean process.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_script, load_average, pct  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch)

import torch  # noqa: E402

GPT_CFG = {"d_model": 128, "n_head": 4, "n_layer": 4, "seq_len": 64, "lr": 1e-3}


def lightning_worker(cfg: dict) -> None:
    """One training run (this process = one rank); writes its step times to cfg['out'].rankR.json."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from pretrain_gpt import BUILTIN_CORPUS, GPT, CharCorpus

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))

    class StepTimer(Callback):
        def __init__(self):
            self.step, self.iteration, self.loss, self.cpu = [], [], [], []
            self._t0 = self._last_end = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._c0 = time.process_time()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            self.cpu.append(time.process_time() - self._c0)
            self.step.append(now - self._t0)
            if self._last_end is not None:
                self.iteration.append(now - self._last_end)
            self._last_end = now
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.loss.append(float(loss) if loss is not None else float("nan"))

    L.seed_everything(0, verbose=False)
    text = BUILTIN_CORPUS * 4
    vocab = sorted(set(text))
    data = CharCorpus(text, GPT_CFG["seq_len"], vocab)
    model = GPT(len(vocab), GPT_CFG["seq_len"], GPT_CFG["d_model"], GPT_CFG["n_head"], cfg.get("n_layer", GPT_CFG["n_layer"]),
                GPT_CFG["lr"])
    kind = cfg["strategy"]
    if kind == "plain":
        strategy, devices = "auto", 1
    elif kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy, devices = DDPStrategy(), int(os.environ["WORLD_SIZE"])
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=cfg.get("tp", 1), pp=cfg.get("pp", 1), vp=cfg.get("vp"),
                                    num_microbatches=cfg.get("num_microbatches"),
                                    tp_plan=GPT.TP_PLAN if cfg.get("tp", 1) > 1 else None)
        devices = int(os.environ.get("WORLD_SIZE", "1"))
    timer = StepTimer()
    # Every run sees the same global batches in the same order: Lightning's automatic
    # distributed sampler would shuffle (it always does for training), so it is off and
    # DDP gets an explicit non-shuffling DistributedSampler; TP/PP ranks all read the full batch.
    sampler = None
    if kind == "ddp":
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(data, num_replicas=devices, rank=rank, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg["steps"], limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer], use_distributed_sampler=False,
    )
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=cfg["batch_size"], shuffle=False, sampler=sampler))
    wall = time.perf_counter() - t0
    Path(f"{cfg['out']}.rank{rank}.json").write_text(json.dumps({
        "rank": rank, "step": timer.step, "cpu": timer.cpu, "iteration": timer.iteration, "loss": timer.loss, "fit_wall_s": wall,
        "strategy_class": type(trainer.strategy).__name__,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


def run_lightning(cfg: dict, nprocs: int, timeout: float) -> dict:
    """Launch one Lightning run; summarize the measured steps (after ``cfg['warmup']``)."""
    tmp = Path(tempfile.mkdtemp(prefix="megabench-"))
    cfg = dict(cfg, out=str(tmp / "run"))
    load_before = load_average()
    launch_script(Path(__file__).resolve(), nprocs, ["--lightning-worker", json.dumps(cfg)], timeout,
                  torchrun_env=cfg["strategy"] != "plain")
    ranks = [json.loads(Path(f"{cfg['out']}.rank{r}.json").read_text()) for r in range(nprocs)]
    w = cfg["warmup"]
    med = [statistics.median(r["step"][w:]) for r in ranks]
    cpu = [statistics.median(r["cpu"][w:]) for r in ranks]
    it = [statistics.median(r["iteration"][w:]) for r in ranks if len(r["iteration"]) > w]
    slow = max(range(nprocs), key=lambda i: med[i])
    steps = ranks[slow]["step"][w:]
    if cfg["strategy"] == "ddp":  # each rank logged the loss of its half batch: average them
        losses = [sum(v) / nprocs for v in zip(*(r["loss"] for r in ranks))]
    else:  # TP/PP ranks report the loss of the whole batch
        losses = ranks[0]["loss"]
    return {
        "median_ms": max(med) * 1e3, "p10_ms": pct(steps, 0.1) * 1e3, "p90_ms": pct(steps, 0.9) * 1e3,
        "cpu_ms": max(cpu) * 1e3, "iteration_ms": max(it) * 1e3 if it else None, "measured_steps": len(steps),
        "final_loss": losses[-1] if losses else None, "losses": losses,
        "strategy_class": ranks[0]["strategy_class"], "per_rank_median_ms": [m * 1e3 for m in med],
        "max_rss_mib": max(r["max_rss_mib"] for r in ranks), "loadavg_before": load_before,
        "loadavg_after": load_average(),
    }


def run_lightning_set(runs: list[tuple[str, int, dict]], base: dict, repeats: int, timeout: float) -> dict[str, dict]:
    """Run every configuration ``repeats`` times, interleaved (A B C A B C ...), and keep, per
    configuration, the run with the lowest median step (the least disturbed by other load)."""
    best: dict[str, dict] = {}
    for rep in range(repeats):
        for name, n, cfg in runs:
            t0 = time.perf_counter()
            r = run_lightning({**base, **cfg}, n, timeout)
            print(f"  [{name} (run {rep + 1}/{repeats}): {time.perf_counter() - t0:.1f}s, median step "
                  f"{r['median_ms']:.1f} ms, cpu {r['cpu_ms']:.1f} ms, load {r['loadavg_before']}]", flush=True)
            all_medians = best.get(name, {}).get("all_medians_ms", []) + [r["median_ms"]]
            if name not in best or r["median_ms"] < best[name]["median_ms"]:
                best[name] = r
            best[name]["all_medians_ms"] = all_medians
    return best


def loss_gap(losses: list[float], ref: list[float]) -> float | None:
    if not losses or not ref:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))


LIGHTNING_NOTES = [
    "step = Callback on_train_batch_start -> on_train_batch_end (forward, backward, optimizer step, "
    "gradient reduction); iteration = on_train_batch_end -> next on_train_batch_end (adds data loading and "
    "batch_to_device, where MegatronStrategy broadcasts the batch over the TP group when tp > 1). "
    "cpu ms = process CPU time in the same window (all threads): insensitive to time the process spent descheduled.",
    "multi-process rows report the slowest rank's median; each configuration ran --repeats times interleaved and the "
    "run with the lowest median is shown ('all medians' lists every run).",
    "loss column: every run trains the same model from the same seed on the same global batches in the same order "
    "(Lightning's shuffling distributed sampler is replaced, see the script), so each step's loss should equal plain "
    "Lightning's up to float rounding; shown is the largest relative difference over all steps.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lightning-worker", required=True, help="JSON configuration of one run (set by run_lightning)")
    lightning_worker(json.loads(p.parse_args().lightning_worker))


if __name__ == "__main__":
    main()
