"""One-GPU benchmark: model FLOPs utilization (MFU) of a BERT-large-sized encoder with
megastrategy's torch and Transformer Engine layers, with and without partial CUDA graphs.

    python bench/bench_gpu.py                        # on a GPU (an H200): the full measurement
    python bench/bench_gpu.py --tiny                 # on a GPU: every path on a tiny model (~1-2 min)
    python bench/bench_gpu.py --device cpu --tiny    # dry run without a GPU (< 1 min): CPU paths only
    python bench/bench_gpu.py --configs L-torch,L-torch+graphs    # a subset (names: --list)

Why: the CPU benchmarks (bench_tp.py, bench_pp.py) count collectives and bytes but cannot say
how fast a training step is where it matters. On one GPU there is no communication, so what
is left is the efficiency of the layers themselves and of what the strategy adds around them:
the fp32 gradient buffer, the backend swap (``backend="te"``), partial CUDA graphs
(``cuda_graph_scope=["attn"]``) and Lightning's loop.

What (world size 1, one process per configuration so that a failed graph capture or an
out-of-memory cannot disturb the next one):

1. The measured bf16 matmul peak: ``torch.matmul`` of two n x n bf16 matrices (n=8192),
   timed with CUDA events after warm-up; the best batch is the MFU denominator (the
   datasheet peak is printed beside it where known).
2. ``transformers.BertForMaskedLM`` built from a config (no download): 24 layers, hidden 1024,
   16 heads, FFN 4096, seq 512, vocab 30522, batch 16, bf16-mixed, AdamW, random tokens with
   15% masked. Two drivers:
   * ``L-*``: ``lightning.Trainer(devices=1, strategy=MegatronStrategy(tp=1, backend=...,
     fp8=..., cuda_graph_scope=...))``; a Callback synchronizes CUDA and times each
     ``on_train_batch_start -> on_train_batch_end`` (forward, backward, optimizer step); the
     first ``--warmup`` steps (lazy init, graph capture) are not counted. ``L-default`` is
     Lightning's own single-device strategy, for the strategy's overhead.
   * ``D-*``: a plain PyTorch loop driving the same module directly (autocast, backward,
     AdamW), with what the strategy does under the hood done by hand:
     ``megastrategy.layers.plan.apply_tp_plan`` at tp=1 (``D-plan``), then
     ``megastrategy.layers.te_backend.convert_to_te`` (``D-te``), and
     ``megastrategy.cuda_graphs.CudaGraphManager`` (``+graphs``). No Lightning overhead.
3. A table: configuration | step ms | tokens/s | MFU | vs torch-eager, where MFU =
   model FLOPs per step (Megatron's formula, printed) / step time / measured peak.

``--device cpu --tiny`` (2 layers, hidden 64, seq 32, 3 steps, fp32) runs every configuration
that does not need CUDA and prints why the others are skipped. Results go to
``bench/results/bench_gpu.{json,md}`` (git-ignored).
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
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (shared tables/report; puts src/ on sys.path)

import torch  # noqa: E402

TE_HINT = "TE not installed: pip install --no-build-isolation transformer_engine[pytorch]"
BERT_LARGE = {"layers": 24, "hidden": 1024, "heads": 16, "ffn": 4096, "seq": 512, "vocab": 30522}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "seq": 32, "vocab": 30522}
# dense bf16 tensor-core peak from the datasheets (TFLOP/s), matched against the device name
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "A100": 312.0}

# name -> (driver, backend, cuda graphs, fp8, description). The ratio column divides by L-torch.
CONFIGS: dict[str, tuple[str, str, bool, bool, str]] = {
    "L-torch": ("lightning", "torch", False, False, 'MegatronStrategy(tp=1, backend="torch")'),
    "L-torch+graphs": ("lightning", "torch", True, False, 'MegatronStrategy(tp=1, backend="torch", cuda_graph_scope=["attn"])'),
    "L-te": ("lightning", "te", False, False, 'MegatronStrategy(tp=1, backend="te")'),
    "L-te+graphs": ("lightning", "te", True, False, 'MegatronStrategy(tp=1, backend="te", cuda_graph_scope=["attn"])'),
    "L-te-fp8": ("lightning", "te", False, True, 'MegatronStrategy(tp=1, backend="te", fp8=True)'),
    "L-te-fp8+graphs": ("lightning", "te", True, True, 'MegatronStrategy(tp=1, backend="te", fp8=True, cuda_graph_scope=["attn"])'),
    "L-default": ("lightning-default", "torch", False, False, "Lightning default strategy (SingleDeviceStrategy), HF layers"),
    "D-hf": ("direct", "hf", False, False, "plain loop, HF layers untouched"),
    "D-hf+graphs": ("direct", "hf", True, False, "plain loop, HF layers + CudaGraphManager(['attn'])"),
    "D-plan": ("direct", "torch", False, False, "plain loop, apply_tp_plan(tp=1): megastrategy torch layers"),
    "D-te": ("direct", "te", False, False, "plain loop, apply_tp_plan(tp=1) + convert_to_te"),
    "D-te+graphs": ("direct", "te", True, False, "plain loop, apply_tp_plan(tp=1) + convert_to_te + CudaGraphManager(['attn'])"),
}
BASELINE = "L-torch"


# ======================================================================================
# FLOPs
# ======================================================================================
def model_flops_per_step(m: dict[str, int], batch: int) -> dict[str, float]:
    """Megatron's count (Narayanan et al. 2021, matmuls only, no recompute), for a general FFN size:
    per layer and token, forward = 8h^2 (QKV + output projection) + 4*h*ffn (MLP) + 4*s*h (QK^T
    and attention x V); the MLM decoder adds 2*h*V; backward = 2 x forward. With ffn = 4h this is
    72*B*s*L*h^2 * (1 + s/(6h) + V/(12hL)). The MLM head's h x h transform (2h^2 per token
    forward) is counted too; it is not in Megatron's GPT formula."""
    h, L, s, V, f = m["hidden"], m["layers"], m["seq"], m["vocab"], m["ffn"]
    tokens = batch * s
    layers = 3 * tokens * L * (8 * h * h + 4 * h * f + 4 * s * h)
    head = 3 * tokens * (2 * h * V + 2 * h * h)
    return {"total": float(layers + head), "layers": float(layers), "head": float(head),
            "megatron_72": float(72 * tokens * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)))}


FLOPS_NOTE = ("model FLOPs per step = 3 x forward matmul FLOPs (Megatron): per layer and token 8h^2 (QKV, out proj) "
              "+ 4*h*ffn (MLP) + 4*s*h (attention scores and values); head 2*h*V (decoder) + 2h^2 (MLM transform). "
              "With ffn=4h: 72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)) + 6*B*s*h^2. MFU = model FLOPs / step time / measured peak; "
              "attention FLOPs are counted in full (no causal halving: BERT is bidirectional).")


# ======================================================================================
# environment
# ======================================================================================
def te_status() -> tuple[bool, str]:
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken build raises OSError/RuntimeError too
        return False, f"{TE_HINT} ({type(err).__name__}: {str(err)[:120]})"
    return True, getattr(transformer_engine, "__version__", "unknown")


def gpu_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device, "cuda_available": torch.cuda.is_available(),
                            "torch_cuda": torch.version.cuda}
    te_ok, te = te_status()
    info["transformer_engine"] = te if te_ok else "not installed"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        info["transformers"] = "n/a"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    return info


def skip_reason(name: str, device: str, te_ok: bool, fp8_ok: bool, want_fp8: bool) -> Optional[str]:
    driver, backend, graphs, fp8, _ = CONFIGS[name]
    if backend == "te" and device != "cuda":
        return "Transformer Engine's layers run only on CUDA (--device cpu)"
    if backend == "te" and not te_ok:
        return TE_HINT
    if graphs and device != "cuda":
        return "CUDA graphs need a CUDA device (--device cpu); the strategy refuses cuda_graph_scope on CPU"
    if fp8 and not want_fp8:
        return "FP8 rows are off (--no-fp8)"
    if fp8 and not fp8_ok:
        return "FP8 needs compute capability >= 8.9 (Ada/Hopper)"
    return None


# ======================================================================================
# 1. matmul peak
# ======================================================================================
def measure_peak(device: str, n: int, dtype: torch.dtype, warmup: int, repeats: int, inner: int) -> dict[str, Any]:
    """Time ``inner`` back-to-back n^3 matmuls ``repeats`` times (CUDA events on GPU)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.matmul(a, b, out=out)
            times.append((time.perf_counter() - t0) / inner)
    flops = 2.0 * n ** 3
    del a, b, out
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "best_tflops": flops / min(times) / 1e12,
            "median_tflops": flops / statistics.median(times) / 1e12, "best_ms": min(times) * 1e3,
            "median_ms": statistics.median(times) * 1e3, "repeats": repeats, "inner": inner}


# ======================================================================================
# 2. training worker (runs in its own process)
# ======================================================================================
def make_module(cfg: dict[str, Any]):
    """A LightningModule around ``BertForMaskedLM`` built from a config (no download)."""
    import lightning as L
    from transformers import BertConfig, BertForMaskedLM

    m = cfg["model"]
    bert_cfg = BertConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
        intermediate_size=m["ffn"], max_position_embeddings=max(512, m["seq"]),
        hidden_dropout_prob=cfg["dropout"], attention_probs_dropout_prob=cfg["dropout"],
    )

    class BertMLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = BertForMaskedLM(bert_cfg)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

    torch.manual_seed(0)
    module = BertMLM()
    return module, getattr(bert_cfg, "_attn_implementation", None)


def make_batches(m: dict[str, int], batch: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` random MLM batches: 15% of the positions masked (id 103) and labelled."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(1000, m["vocab"], (batch, m["seq"]), generator=g)
        masked = torch.rand(batch, m["seq"], generator=g) < 0.15
        masked[:, 0] = True  # at least one label per row
        out.append({"input_ids": torch.where(masked, torch.full_like(ids, 103), ids),
                    "labels": torch.where(masked, ids, torch.full_like(ids, -100))})
    return out


class _Batches(torch.utils.data.Dataset):
    """Serves ``steps`` batches (already collated) cycling over a small pool."""

    def __init__(self, pool, steps):
        self.pool, self.steps = pool, steps

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        return self.pool[i % len(self.pool)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_lightning(cfg: dict[str, Any], module, pool) -> dict[str, Any]:
    import lightning as L

    device = cfg["device"]
    driver, backend, graphs, fp8, _ = CONFIGS[cfg["name"]]

    class StepTimer(L.Callback):
        def __init__(self):
            self.step, self.iteration, self.loss = [], [], []
            self._t0 = self._last = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            _sync(device)
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _sync(device)
            now = time.perf_counter()
            self.step.append(now - self._t0)
            if self._last is not None:
                self.iteration.append(now - self._last)
            self._last = now
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.loss.append(float(loss))

    if driver == "lightning-default":
        strategy = "auto"
    else:
        from megastrategy import MegatronStrategy

        strategy = MegatronStrategy(tp=1, backend=backend, fp8=fp8, cuda_graph_scope=["attn"] if graphs else None)
    timer = StepTimer()
    steps = cfg["warmup"] + cfg["steps"]
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=strategy, precision=cfg["precision"],
        max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        use_distributed_sampler=False,  # same batches in the same order for every configuration
    )
    loader = torch.utils.data.DataLoader(_Batches(pool, steps), batch_size=None, shuffle=False)
    trainer.fit(module, loader)
    result: dict[str, Any] = {"step_s": timer.step, "iteration_s": timer.iteration, "loss": timer.loss,
                              "strategy_class": type(trainer.strategy).__name__}
    s = trainer.strategy
    if driver == "lightning":
        from megastrategy.cuda_graphs.component import CudaGraphs
        from megastrategy.layers.components import TransformerEngine

        te, graphs = s.component(TransformerEngine), s.component(CudaGraphs)
        result["backend_in_use"] = te.backend_in_use
        report = te.report
        result["te_converted"] = None if report is None else len(report.converted)
        result["te_kept"] = None if report is None else len(report.kept)
        if graphs is not None and graphs.manager is not None:
            result["graph_counts"] = dict(graphs.manager.counts())
            rep = graphs.manager.report
            result["graph_capture"] = None if rep is None else {
                "backend": rep.backend, "calls": len(rep.calls), "failed": rep.failed, "not_recorded": rep.not_recorded}
    return result


def run_direct(cfg: dict[str, Any], module, pool) -> dict[str, Any]:
    """The same module without Lightning: what the strategy does, done by hand at tp=1."""
    import torch.distributed as dist

    device = cfg["device"]
    _, backend, graphs, _, _ = CONFIGS[cfg["name"]]  # no FP8 rows in the direct driver
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    module.to(dev).train()
    result: dict[str, Any] = {}
    if backend in ("torch", "te"):
        from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear
        from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
        from megastrategy.layers.random import ModelParallelRNGTracker

        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0, world_size=1)
        group = dist.new_group([0])
        tracker = ModelParallelRNGTracker(tp_rank=0, device=dev)
        tracker.seed(0)
        apply_tp_plan(module, resolve_tp_plan(module, None, 1), group=group, rng_tracker=tracker)
        result["tp_layers"] = sum(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in module.modules())
        if backend == "te":
            from megastrategy.layers.te_backend import convert_to_te

            report = convert_to_te(module, tp_group=group, tp_size=1)
            result["te_converted"], result["te_kept"] = len(report.converted), len(report.kept)
    manager = None
    if graphs:
        from megastrategy.cuda_graphs import CudaGraphManager
        from megastrategy.pipeline.stage import find_layer_stack

        path, stack = find_layer_stack(module)
        manager = CudaGraphManager(stack, ["attn"], stack_path=path)
    optimizer = module.configure_optimizers()
    bf16 = cfg["precision"] == "bf16-mixed"
    batches = [{k: v.to(dev) for k, v in b.items()} for b in pool]
    step_s, loss_log = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        batch = batches[i % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        if manager is not None:
            manager.begin_step(1)
            manager.on_forward(0, 0)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = module.training_step(batch, i)
        loss.backward()
        if manager is not None:
            manager.on_backward(0, 0)
            manager.end_step()  # captures after the first step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        step_s.append(time.perf_counter() - t0)
        loss_log.append(float(loss.detach()))
    result.update(step_s=step_s, iteration_s=[], loss=loss_log)
    if manager is not None:
        result["graph_counts"] = dict(manager.counts())
        rep = manager.report
        result["graph_capture"] = None if rep is None else {
            "backend": rep.backend, "calls": len(rep.calls), "failed": rep.failed, "not_recorded": rep.not_recorded}
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def worker(cfg: dict[str, Any]) -> None:
    """Entry point of one configuration's process: writes its result JSON to ``cfg['out']``."""
    t0 = time.perf_counter()
    device = cfg["device"]
    if device == "cpu":
        torch.set_num_threads(cfg["threads"])
    module, attn_impl = make_module(cfg)
    n_params = sum(p.numel() for p in module.parameters())
    pool = make_batches(cfg["model"], cfg["batch"], cfg["pool"])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = run_direct if CONFIGS[cfg["name"]][0] == "direct" else run_lightning
    result = run(cfg, module, pool)
    result.update(n_params=n_params, attn_implementation=attn_impl, wall_s=time.perf_counter() - t0,
                  max_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)
    Path(cfg["out"]).write_text(json.dumps(result))


def launch(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one configuration in a fresh process; ``{"error": ...}`` on failure or timeout."""
    out = Path(tempfile.mkdtemp(prefix="bench-gpu-")) / "result.json"
    cfg = dict(cfg, out=str(out))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(common.REPO), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-2000:] if isinstance(err.stdout, bytes) else (err.stdout or "")[-2000:]
        return {"error": f"timed out after {timeout:.0f}s", "log_tail": str(tail)}
    if proc.returncode != 0 or not out.exists():
        log = (proc.stdout + proc.stderr).strip().splitlines()
        last = next((l for l in reversed(log) if l.strip() and not l.startswith(" ")), "")
        return {"error": f"exit code {proc.returncode}: {last[:300]}", "log_tail": "\n".join(log[-40:])}
    return json.loads(out.read_text())


# ======================================================================================
# 3. report
# ======================================================================================
def summarize(r: dict[str, Any], warmup: int, tokens: int, flops: float, peak_tflops: float) -> dict[str, Any]:
    steps = r["step_s"][warmup:]
    med = statistics.median(steps)
    its = r.get("iteration_s", [])[max(warmup - 1, 0):]
    return {"step_ms": med * 1e3, "p10_ms": common.pct(steps, 0.1) * 1e3, "p90_ms": common.pct(steps, 0.9) * 1e3,
            "iteration_ms": statistics.median(its) * 1e3 if its else None, "tokens_per_s": tokens / med,
            "tflops": flops / med / 1e12, "mfu": flops / med / 1e12 / peak_tflops, "measured_steps": len(steps)}


def row_notes(name: str, r: dict[str, Any]) -> str:
    """What actually ran: converted TE layers, graph replays, and anything that makes a row mislead."""
    parts = []
    backend = CONFIGS[name][1]
    if backend == "te":
        conv = r.get("te_converted")
        parts.append(f"TE layers: {conv} converted, {r.get('te_kept')} kept")
        if conv == 0:
            parts.append("NOTHING CONVERTED: this row ran torch layers")
    if r.get("tp_layers") is not None:
        parts.append(f"{r['tp_layers']} megastrategy linear layers")
    if CONFIGS[name][2]:
        counts = r.get("graph_counts") or {}
        replays = counts.get("replay", 0)
        eager = {k: v for k, v in counts.items() if k != "replay"}
        parts.append(f"graph replays {replays}" + (f", eager {eager}" if eager else ""))
        cap = r.get("graph_capture") or {}
        if cap.get("failed"):
            parts.append(f"capture failed for {len(cap['failed'])}")
        if replays == 0:
            parts.append("NO REPLAYS: this row ran eagerly")
    return "; ".join(parts) or "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, seq 32, 3 steps (a dry run)")
    p.add_argument("--batch", type=int, help="sequences per step (default 16; --tiny 4)")
    p.add_argument("--steps", type=int, help="measured steps (default 20; --tiny 3)")
    p.add_argument("--warmup", type=int, help="steps not measured: lazy init, graph capture (default 5; --tiny 2)")
    p.add_argument("--precision", help="Lightning precision (default bf16-mixed on cuda, 32-true on cpu)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout (default 0; >0 with the tp=1 plan makes 'attn' graphs refuse TP-RNG dropout)")
    p.add_argument("--configs", help="comma-separated configuration names (default: all that can run; see --list)")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8 rows")
    p.add_argument("--peak-n", type=int, help="matmul size for the peak (default 8192; --tiny 512)")
    p.add_argument("--timeout", type=float, default=600, help="hard limit per configuration, seconds")
    p.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.list:
        for name, (_, _, _, _, desc) in CONFIGS.items():
            print(f"{name:18} {desc}")
        return
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False; use --device cpu --tiny for a dry run")
    tiny = args.tiny
    model = dict(TINY if tiny else BERT_LARGE)
    batch = args.batch or (4 if tiny else 16)
    steps = args.steps or (3 if tiny else 20)
    warmup = args.warmup if args.warmup is not None else (2 if tiny else 5)
    precision = args.precision or ("bf16-mixed" if device == "cuda" else "32-true")
    names = [n.strip() for n in args.configs.split(",")] if args.configs else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")

    info = common.machine_info()
    info.update(gpu_info(device))
    te_ok, _ = te_status()
    fp8_ok = device == "cuda" and torch.cuda.get_device_capability(0) >= (8, 9)
    tokens = batch * model["seq"]
    flops = model_flops_per_step(model, batch)
    config = {"model": model, "batch": batch, "tokens_per_step": tokens, "steps": steps, "warmup": warmup,
              "precision": precision, "dropout": args.dropout, "device": device, "tiny": tiny,
              "model_flops_per_step": flops}
    report = common.Report("bench_gpu", "megastrategy one-GPU MFU benchmark (bench/bench_gpu.py)", info, config)
    gpu_line = (f"device: {info.get('gpu', 'CPU (dry run)')}"
                + (f" (sm {info['capability']}, {info['gpu_memory_gib']} GiB, {info['sms']} SMs)" if device == "cuda" else "")
                + f" | torch CUDA {info['torch_cuda']} | transformer_engine {info['transformer_engine']} | "
                f"transformers {info['transformers']}")
    print(gpu_line + "\n", flush=True)
    t_start = time.perf_counter()

    # 1. peak --------------------------------------------------------------------------------
    n = args.peak_n or (512 if tiny else 8192)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    peak = measure_peak(device, n, dtype, warmup=5 if device == "cuda" else 2, repeats=10 if device == "cuda" else 3,
                        inner=10 if device == "cuda" else 2)
    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in info.get("gpu", "")), None)
    report.table(
        f"1. Matmul peak: torch.matmul {n}x{n}x{n} {peak['dtype']}",
        ["dtype", "n", "best TFLOP/s (MFU denominator)", "median TFLOP/s", "best ms", "datasheet bf16 TFLOP/s",
         "measured / datasheet"],
        [[peak["dtype"], n, peak["best_tflops"], peak["median_tflops"], peak["best_ms"],
          datasheet, common.ratio(peak["best_tflops"], datasheet)]],
        notes=[f"{peak['repeats']} batches of {peak['inner']} back-to-back matmuls after {5 if device == 'cuda' else 2} "
               "warm-up, " + ("timed with CUDA events; " if device == "cuda" else "timed with perf_counter (CPU); ")
               + "FLOPs = 2n^3 per matmul; the best batch is the peak."]
        + ([] if device == "cuda" else ["CPU dry run: fp32 on the CPU, so the MFU below is against a CPU peak."]),
        raw=peak,
    )
    peak_tflops = peak["best_tflops"]

    # 2. configurations ----------------------------------------------------------------------------
    print(f"model: BertForMaskedLM {model}, batch {batch} ({tokens} tokens/step), {precision}, AdamW, "
          f"dropout {args.dropout}; {warmup} warm-up + {steps} measured steps per configuration", flush=True)
    print(f"model FLOPs per step: {flops['total']:.4g} (layers {flops['layers']:.4g} + head {flops['head']:.4g}; "
          f"Megatron 72*B*s*L*h^2*(1+s/6h+V/12hL) = {flops['megatron_72']:.4g})\n", flush=True)
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    base_cfg = {"device": device, "model": model, "batch": batch, "steps": steps, "warmup": warmup,
                "precision": precision, "dropout": args.dropout, "pool": 4, "threads": 1}  # CPU: one thread, as the other benches
    for name in names:
        why = skip_reason(name, device, te_ok, fp8_ok, not args.no_fp8)
        if why:
            skipped[name] = why
            print(f"  [{name}: skipped: {why}]", flush=True)
            continue
        t0 = time.perf_counter()
        r = launch(dict(base_cfg, name=name), args.timeout)
        if "error" in r:
            print(f"  [{name}: FAILED after {time.perf_counter() - t0:.0f}s: {r['error']}]\n{r.get('log_tail', '')}\n",
                  flush=True)
        else:
            r["summary"] = summarize(r, warmup, tokens, flops["total"], peak_tflops)
            print(f"  [{name}: {time.perf_counter() - t0:.0f}s, step {r['summary']['step_ms']:.2f} ms, "
                  f"MFU {r['summary']['mfu']:.3f}, final loss {r['loss'][-1]:.3f}; {row_notes(name, r)}]", flush=True)
        results[name] = r

    base = results.get(BASELINE, {}).get("summary")
    rows = []
    for name, r in results.items():
        driver, backend, graphs, fp8, desc = CONFIGS[name]
        if "error" in r:
            rows.append([name, desc, "FAILED", "-", "-", "-", "-", "-", "-", "-", r["error"][:160]])
            continue
        s = r["summary"]
        eager_twin = name.replace("+graphs", "")
        twin = results.get(eager_twin, {}).get("summary") if graphs else None
        rows.append([
            name, desc, s["step_ms"], f"{common.fmt_num(s['p10_ms'])}-{common.fmt_num(s['p90_ms'])}", round(s["tokens_per_s"]),
            s["tflops"], s["mfu"], common.ratio(s["step_ms"], base["step_ms"]) if base else None,
            common.ratio(s["step_ms"], twin["step_ms"]) if twin else "-",
            r["max_memory_gib"], row_notes(name, r),
        ])
    for name, why in skipped.items():
        rows.append([name, CONFIGS[name][4], "skipped", "-", "-", "-", "-", "-", "-", "-", why])
    first = next((r for r in results.values() if "error" not in r), None)
    report.table(
        f"2. BertForMaskedLM {model['layers']}L h={model['hidden']} heads={model['heads']} ffn={model['ffn']} "
        f"s={model['seq']} V={model['vocab']}, batch {batch}, {precision}, AdamW, one {'GPU' if device == 'cuda' else 'CPU process'}, "
        f"median over {steps} steps after {warmup} warm-up",
        ["configuration", "what runs", "step ms", "p10-p90 ms", "tokens/s", "model TFLOP/s", "MFU",
         f"step vs {BASELINE}", "step vs same w/o graphs", "max mem GiB", "notes"],
        rows,
        notes=[
            FLOPS_NOTE,
            f"params: {first['n_params']:,}; attention implementation: {first['attn_implementation']}." if first else "no run succeeded.",
            "L-*: lightning.Trainer(devices=1); step = CUDA-synchronized Callback on_train_batch_start -> "
            "on_train_batch_end (forward, backward, optimizer step, gradient buffer). D-*: the same module in a plain "
            "loop (autocast, backward, AdamW), CUDA-synchronized per step, no Lightning.",
            "every configuration runs in its own process from the same seed and batches; the ratios divide step times "
            "(< 1 = faster). '+graphs' rows: the first step records, captures at its end; warm-up steps are excluded.",
            "MegatronStrategy applies the tensor-parallel plan only when tp > 1, so at tp=1 backend='te' finds no "
            "Column/RowParallelLinear to convert (see the TE-layers note of L-te*); D-te applies the plan at tp=1 by "
            "hand and then converts, which is what the strategy would need to do.",
        ],
        raw={"results": {k: {kk: vv for kk, vv in v.items() if kk not in ("iteration_s",)} for k, v in results.items()},
             "skipped": skipped, "peak_tflops": peak_tflops},
    )
    js, md = report.save(args.out_dir)
    print(f"total {time.perf_counter() - t_start:.0f}s; wrote {js} and {md}", flush=True)


if __name__ == "__main__":
    main()
