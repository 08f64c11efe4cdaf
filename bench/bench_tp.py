"""Tensor-parallel benchmark: collectives per transformer layer, vocab-parallel loss traffic,
and the step-time overhead of MegatronStrategy inside Lightning.

    OMP_NUM_THREADS=1 python bench/bench_tp.py            # everything (a few minutes on 2 cores)
    python bench/bench_tp.py --skip-lightning              # only the collective counts
    python bench/bench_tp.py --steps 20 --warmup 5         # shorter Lightning runs

Sections (all on real processes: gloo over 127.0.0.1, one thread per process):

1. One transformer layer (h=256, 8 heads, FFN 4h, b=4, s=64, fp32) at tp = 1, 2, 4: the
   collectives one forward + backward issues and the bytes they move, counted twice
   (megastrategy's ``record_collectives()`` and an independent TorchDispatchMode that sees
   every ``c10d`` op), beside the minimum (2 all-reduces of b*s*h forward, 2 backward).
   Built Megatron-style from ColumnParallelLinear/RowParallelLinear and as a Hugging Face
   ``BertLayer`` sharded by the built-in plan.
2. The vocab-parallel cross entropy (b*s tokens, V=30522): bytes the head + loss move,
   beside all-gathering the logits.
3. Lightning step time: MegatronStrategy(tp=1) vs Lightning's default single-device
   strategy on one process, and MegatronStrategy(tp=2) vs DDP on two processes.

Results are printed and written to bench/results/bench_tp.{json,md}. ``bench_pp.py``
imports the small helpers below (machine info, launchers, tables).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import queue
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every child
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
for _p in (REPO / "src", REPO / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

# ======================================================================================
# shared helpers (also used by bench_pp.py)
# ======================================================================================


def machine_info() -> dict[str, Any]:
    """Date, CPU and software versions, for the header of every result."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        import lightning

        lightning_version = lightning.__version__
    except ImportError:  # pragma: no cover
        lightning_version = "n/a"
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu_model": cpu,
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning_version,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
    }


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"date: {info['date']} | machine: {info['cpu_cores']} cores ({info['usable_cores']} usable), "
        f"{info['cpu_model']}, {info['memory_gib']} GiB | torch {info['torch']}, lightning "
        f"{info['lightning']}, python {info['python']}, OMP_NUM_THREADS={info['omp_num_threads']}"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(fn, rank, world, port, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch as _torch
    import torch.distributed as dist

    _torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes (gloo initialized);
    return the values by rank. Any failure or the timeout kills every process."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawn_entry, args=(fn, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    error = None
    try:
        while len(values) < world and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"timed out after {timeout:.0f}s (finished ranks: {sorted(values)})"
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)
                    if results.empty():
                        error = f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}"
                continue
            if ok:
                values[rank] = value
            else:
                error = f"rank {rank} failed:\n{value}"
    finally:
        for p in procs:
            p.join(timeout=5 if error is None else 0)
            if p.is_alive():
                p.kill()
                p.join()
    if error is not None:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} on {world} processes: {error}")
    return [values[r] for r in range(world)]


def launch_script(script: Path, nprocs: int, argv: list[str], timeout: float, *, torchrun_env: bool = True) -> list[str]:
    """Start ``python script argv`` on ``nprocs`` processes (torchrun-style environment unless
    ``torchrun_env`` is False); return each rank's output. Kills all on failure or timeout."""
    env = dict(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]))
    if torchrun_env:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs), NODE_RANK="0")
    procs, logs = [], []
    for rank in range(nprocs):
        penv = dict(env)
        if torchrun_env:
            penv.update(RANK=str(rank), LOCAL_RANK=str(rank))
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *argv], env=penv, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=str(REPO)))
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failure = f"rank {bad[0]} exited with code {codes[bad[0]]}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout:.0f}s"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if failure:
        tails = "\n".join(f"----- rank {r} -----\n{o[-4000:]}" for r, o in enumerate(outputs))
        raise RuntimeError(f"{script.name} {' '.join(argv)[:200]} on {nprocs} processes: {failure}\n{tails}")
    return outputs


def fmt_num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:
            return "nan"
        if x == 0:
            return "0"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) < 1e-3:
            return f"{x:.2e}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{max(digits - 1, 1)}f}".rstrip("0").rstrip(".")
    return str(x)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt_num(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sep = "-+-".join("-" * w for w in widths)
    lines = [" | ".join(c.ljust(w) for c, w in zip(cells[0], widths)), sep]
    lines += [" | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells[1:]]
    return "\n".join(lines)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def esc(c: Any) -> str:
        return (c if isinstance(c, str) else fmt_num(c)).replace("|", "\\|")

    out = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


class Report:
    """Collects titled tables and notes; prints them as they come and saves JSON + markdown."""

    def __init__(self, name: str, title: str, info: dict[str, Any], config: dict[str, Any]):
        self.name, self.title, self.info, self.config = name, title, info, config
        self.sections: list[dict[str, Any]] = []
        print(f"# {title}\n{machine_line(info)}\n", flush=True)

    def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = (),
              raw: Any = None) -> None:
        self.sections.append({"title": title, "headers": list(headers), "rows": [list(r) for r in rows],
                              "notes": list(notes), "raw": raw})
        print(f"## {title}\n{text_table(headers, rows)}", flush=True)
        for n in notes:
            print(f"  * {n}", flush=True)
        print(flush=True)

    def save(self, out_dir: Path) -> tuple[Path, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        js = out_dir / f"{self.name}.json"
        md = out_dir / f"{self.name}.md"
        js.write_text(json.dumps({"title": self.title, "machine": self.info, "config": self.config,
                                  "sections": self.sections}, indent=1, default=str))
        parts = [f"# {self.title}", "", machine_line(self.info), "",
                 "config: `" + json.dumps(self.config, default=str) + "`", ""]
        for s in self.sections:
            parts += [f"## {s['title']}", "", md_table(s["headers"], s["rows"]), ""]
            parts += [f"* {n}" for n in s["notes"]]
            if s["notes"]:
                parts.append("")
        md.write_text("\n".join(parts))
        return js, md


def pct(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# ======================================================================================
# section 1: collectives of one transformer layer
# ======================================================================================
H, HEADS, FFN, B, S = 256, 8, 1024, 4, 64
VOCAB = 30522

_C10D_INPUT_ARG = {  # c10d op -> positional argument holding this rank's input
    "allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "reduce_": 0,
    "_allgather_base_": 1, "allgather_": 1, "allgather_into_tensor_coalesced_": 1,
    "_reduce_scatter_base_": 1, "reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1,
    "alltoall_base_": 1, "send": 0, "recv_": 0,
}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def c10d_counter():
    """A TorchDispatchMode that records every c10d op (name, input bytes) run under it,
    independent of megastrategy's own recorder."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class C10dCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = func._schema.name.split("::")[-1]
                idx = _C10D_INPUT_ARG.get(name)
                self.ops.append((name, _nbytes(args[idx]) if idx is not None and idx < len(args) else 0))
            return func(*args, **(kwargs or {}))

    return C10dCounter()


def _wire_bytes(op: str, payload: int, tp: int) -> float:
    """Bytes one rank sends with a ring algorithm for a collective whose recorded payload
    (megastrategy's definition) is ``payload``."""
    if tp <= 1:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (tp - 1) / tp * payload
    if op == "all_gather":
        return (tp - 1) * payload  # payload = the local piece
    if op == "reduce_scatter":
        return (tp - 1) / tp * payload  # payload = the full input
    return float(payload)


def _summ(records) -> dict[str, Any]:
    ops: dict[str, int] = {}
    for r in records:
        ops[r.op] = ops.get(r.op, 0) + 1
    return {"count": len(records), "bytes": sum(r.bytes for r in records), "ops": ops}


class RefBlock(torch.nn.Module):
    """A plain pre-LN transformer layer (separate q/k/v), the unsharded reference."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.proj = nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)

    def attn(self, q, k, v, heads):
        import torch.nn.functional as F

        b, s, _ = q.shape
        q, k, v = (t.view(b, s, heads, H // HEADS).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, heads * (H // HEADS))

    def forward(self, x):
        import torch.nn.functional as F

        a = self.ln1(x)
        x = x + self.proj(self.attn(self.q(a), self.k(a), self.v(a), HEADS))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MegatronBlock(RefBlock):
    """The same layer built from megastrategy's ColumnParallelLinear / RowParallelLinear,
    weights copied from a RefBlock. ``qkv``: ``shared`` (separate q/k/v behind one
    SharedInputCopy), ``packed`` (one column layer over [q|k|v], packed_chunks=3) or
    ``naive`` (separate q/k/v, each with its own input copy: 3 backward all-reduces)."""

    def __init__(self, ref: RefBlock, group, qkv: str):
        torch.nn.Module.__init__(self)
        from megastrategy.layers.linear import ColumnParallelLinear as Col
        from megastrategy.layers.linear import RowParallelLinear as Row
        from megastrategy.layers.mappings import SharedInputCopy, group_world_size

        tp = group_world_size(group)
        self.heads, self.qkv_mode = HEADS // tp, qkv
        self.ln1, self.ln2 = ref.ln1, ref.ln2
        if qkv == "packed":
            w = torch.cat([ref.q.weight, ref.k.weight, ref.v.weight])
            b = torch.cat([ref.q.bias, ref.k.bias, ref.v.bias])
            self.qkv = Col.from_weight(w, b, group=group, packed_chunks=3)
        else:
            shared = SharedInputCopy(group) if qkv == "shared" else None
            self.q, self.k, self.v = (Col.from_linear(m, group=group, input_copy=shared) for m in (ref.q, ref.k, ref.v))
        self.proj = Row.from_linear(ref.proj, group=group)
        self.fc1 = Col.from_linear(ref.fc1, group=group)
        self.fc2 = Row.from_linear(ref.fc2, group=group)

    def forward(self, x):
        import torch.nn.functional as F

        a = self.ln1(x)
        if self.qkv_mode == "packed":
            q, k, v = self.qkv(a).chunk(3, dim=-1)
        else:
            q, k, v = self.q(a), self.k(a), self.v(a)
        x = x + self.proj(self.attn(q, k, v, self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _bert_layer():
    """A Hugging Face BertLayer (config built locally, no download), inside a wrapper so that
    the layer is a named child the plan can address."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = BertConfig(vocab_size=128, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                     intermediate_size=FFN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "sdpa"

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = BertLayer(cfg)

        def forward(self, x):
            out = self.layer(x)
            return out[0] if isinstance(out, tuple) else out

    return Wrapper()


def _measure_layer(build: Callable[[], torch.nn.Module], ref_out, ref_grad, x, g, tp: int, iters: int) -> dict:
    from megastrategy.layers.mappings import record_collectives

    layer = build()
    xi = x.clone().requires_grad_(True)
    counter = c10d_counter()
    with counter:
        with record_collectives() as fwd:
            y = layer(xi)
        with record_collectives() as bwd:
            y.backward(g)
    err = max((y.detach() - ref_out).abs().max().item(), (xi.grad - ref_grad).abs().max().item())
    times, cpu = [], []
    for i in range(iters + 3):
        xi = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        c0 = time.process_time()
        t0 = time.perf_counter()
        layer(xi).backward(g)
        if i >= 3:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    f, b = _summ(fwd), _summ(bwd)
    return {
        "fwd": f, "bwd": b,
        "wire_bytes": sum(_wire_bytes(r.op, r.bytes, tp) for r in list(fwd) + list(bwd)),
        "c10d_count": len(counter.ops), "c10d_bytes": sum(n for _, n in counter.ops),
        "c10d_ops": sorted({n for n, _ in counter.ops}),
        "max_abs_err": err, "ms": statistics.median(times) * 1e3, "cpu_ms": statistics.median(cpu) * 1e3,
    }


def _vocab_loss(rank: int, tp: int, iters: int) -> dict:
    """Head + cross entropy over V=30522 for b*s tokens: vocab-parallel vs gathered logits."""
    import torch.nn.functional as F
    from torch import nn

    from megastrategy.layers.mappings import (copy_to_tensor_parallel_region, gather_from_tensor_parallel_region,
                                              record_collectives)
    from megastrategy.layers.vocab_head import VocabParallelHead

    group = torch.distributed.group.WORLD
    torch.manual_seed(5)
    full = nn.Linear(H, VOCAB, bias=False)
    x = torch.randn(B, S, H)
    target = torch.randint(0, VOCAB, (B, S))
    xr = x.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(full(xr).view(-1, VOCAB), target.view(-1))
    ref_loss.backward()
    head = VocabParallelHead.from_linear(full, group=group)

    def ours(xi):
        return F.cross_entropy(head(xi).view(-1, VOCAB), target.view(-1))

    def gathered(xi):  # the same sharded weight, but the logits are all-gathered before the loss
        local = F.linear(copy_to_tensor_parallel_region(xi, group), head.weight)
        logits = gather_from_tensor_parallel_region(local, group)[..., :VOCAB]
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.view(-1))

    out = {}
    for name, fn in (("vocab-parallel CE", ours), ("all-gather logits + CE", gathered)):
        xi = x.clone().requires_grad_(True)
        counter = c10d_counter()
        with counter:
            with record_collectives() as fwd:
                loss = fn(xi)
            with record_collectives() as bwd:
                loss.backward()
        err = max(abs(loss.item() - ref_loss.item()), (xi.grad - xr.grad).abs().max().item())
        times, cpu = [], []
        for i in range(iters + 1):
            xi = x.clone().requires_grad_(True)
            head.zero_grad(set_to_none=True)
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn(xi).backward()
            if i >= 1:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        out[name] = {
            "fwd": _summ(fwd), "bwd": _summ(bwd),
            "fwd_wire": sum(_wire_bytes(r.op, r.bytes, tp) for r in fwd),
            "bwd_wire": sum(_wire_bytes(r.op, r.bytes, tp) for r in bwd),
            "c10d_count": len(counter.ops), "err": err, "ms": statistics.median(times) * 1e3,
            "cpu_ms": statistics.median(cpu) * 1e3,
        }
    return out


def comm_worker(rank: int, world: int, iters: int, with_vocab: bool) -> dict:
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
    from megastrategy.layers.random import ModelParallelRNGTracker

    group = torch.distributed.group.WORLD
    torch.manual_seed(0)
    x = torch.randn(B, S, H)
    g = torch.randn(B, S, H)
    results: dict[str, Any] = {}

    # Megatron-style layers from one reference block (identical on every rank: same seed)
    torch.manual_seed(1)
    ref = RefBlock()
    xr = x.clone().requires_grad_(True)
    ref_out = ref(xr)
    ref_out.backward(g)
    ref_out, ref_grad = ref_out.detach(), xr.grad
    for mode in ("shared", "packed", "naive"):
        results[f"megatron/{mode}"] = _measure_layer(lambda: MegatronBlock(ref, group, mode), ref_out, ref_grad,
                                                     x, g, world, iters)

    # Hugging Face BertLayer, sharded by the built-in plan
    torch.manual_seed(2)
    bert = _bert_layer()
    xr = x.clone().requires_grad_(True)
    bert_out = bert(xr)
    bert_out.backward(g)
    bert_out, bert_grad = bert_out.detach(), xr.grad
    plan_text = ""

    def build_bert():
        nonlocal plan_text
        import copy

        m = copy.deepcopy(bert)
        m.zero_grad(set_to_none=True)
        if world > 1:
            plan = resolve_tp_plan(m, None, world)
            plan_text = plan.table()
            tracker = ModelParallelRNGTracker(tp_rank=rank, device="cpu")
            tracker.seed(1234)
            apply_tp_plan(m, plan, group=group, rng_tracker=tracker)
        return m

    results["hf/bert"] = _measure_layer(build_bert, bert_out, bert_grad, x, g, world, iters)
    results["hf/bert"]["plan"] = plan_text
    if with_vocab and world > 1:  # the head + loss, only where asked (V=30522 makes it the slow part)
        results["vocab"] = _vocab_loss(rank, world, 3)
    return results


LAYER_LABELS = {
    "megatron/shared": "(a) Megatron-style, q/k/v + SharedInputCopy",
    "megatron/packed": "(a') Megatron-style, packed qkv",
    "megatron/naive": "(a'') q/k/v, one input copy each (contrast)",
    "hf/bert": "(b) HF BertLayer + built-in plan",
}


def section_comm(report: Report, tps: Sequence[int], vocab_tps: Sequence[int], iters: int, timeout: float) -> None:
    per_tp = {}
    for tp in tps:
        t0 = time.perf_counter()
        per_tp[tp] = spawn(comm_worker, tp, iters, tp in vocab_tps, timeout=timeout)
        print(f"  [tp={tp}: {time.perf_counter() - t0:.1f}s]", flush=True)
    bsh = B * S * H
    rows, raw = [], {}
    for key, label in LAYER_LABELS.items():
        for tp in tps:
            r = per_tp[tp][0][key]
            raw[f"{key}/tp{tp}"] = {k: v for k, v in r.items()}
            min_count = 4 if tp > 1 else 0
            min_bytes = 4 * bsh * 4 if tp > 1 else 0
            got_bytes = r["fwd"]["bytes"] + r["bwd"]["bytes"]
            ms_ranks = [per_tp[tp][k][key]["ms"] for k in range(tp)]
            cpu_ranks = [per_tp[tp][k][key]["cpu_ms"] for k in range(tp)]
            ops = ",".join(f"{k}x{v}" for k, v in sorted({**r["fwd"]["ops"]}.items())) or "-"
            bops = ",".join(f"{k}x{v}" for k, v in sorted(r["bwd"]["ops"].items())) or "-"
            rows.append([
                label, tp, f"{r['fwd']['count']} ({ops})", f"{r['bwd']['count']} ({bops})",
                got_bytes, r["c10d_count"], min_count, min_bytes,
                "-" if tp == 1 else fmt_num(ratio(got_bytes, min_bytes)),
                r["max_abs_err"], max(ms_ranks), max(cpu_ranks),
            ])
    report.table(
        f"1. Collectives per forward+backward of ONE transformer layer (h={H}, heads={HEADS}, FFN={FFN}, b={B}, s={S}, fp32), per rank",
        ["layer", "tp", "fwd collectives", "bwd collectives", "bytes (recorder)", "c10d ops seen",
         "min collectives", "min bytes", "bytes / min", "max |err| vs unsharded", "fwd+bwd ms (slowest rank)",
         "fwd+bwd cpu ms"],
        rows,
        notes=[
            f"min = 2 all-reduces of b*s*h forward + 2 backward = 4 x {bsh:,} x 4 B = {4 * bsh * 4:,} B per layer per rank (all-reduce payload).",
            "bytes (recorder) = sum of the tensor each rank hands to the collective, from megastrategy.layers.mappings.record_collectives(); "
            "'c10d ops seen' counts every c10d op an independent TorchDispatchMode saw in the same forward+backward (should equal the recorder's count).",
            "max |err| = largest difference of the layer output and input gradient against the unsharded layer (fp32).",
            "(a'') is NOT a recommended build: separate q/k/v without a shared input copy all-reduce the same input gradient 3 times; shown to make the SharedInputCopy saving visible.",
            "fwd+bwd ms / cpu ms: median wall-clock / process CPU time of one forward+backward (20 iterations, slowest "
            f"rank); tp=4 runs 4 processes on {os.cpu_count()} cores, so its wall time measures oversubscription, not "
            "speed-up. The layer is small: these are context, not the point of this table.",
        ],
        raw=raw,
    )
    plan = per_tp[max(tps)][0]["hf/bert"].get("plan")
    if plan:
        print(f"built-in plan applied to the BertLayer at tp={max(tps)}:\n{plan}\n", flush=True)

    rows, raw = [], {}
    n_tok = B * S
    for tp in [t for t in tps if t > 1 and t in vocab_tps]:
        gather_theory = n_tok * VOCAB * 4 * (tp - 1) / tp
        for name, r in per_tp[tp][0]["vocab"].items():
            raw[f"{name}/tp{tp}"] = r
            loss_payload = r["fwd"]["bytes"]
            rows.append([
                name, tp,
                f"{r['fwd']['count']} ({','.join(f'{k}x{v}' for k, v in sorted(r['fwd']['ops'].items()))})",
                loss_payload, r["fwd_wire"],
                f"{r['bwd']['count']} ({','.join(f'{k}x{v}' for k, v in sorted(r['bwd']['ops'].items()))})",
                r["bwd"]["bytes"], r["fwd_wire"] + r["bwd_wire"], gather_theory,
                ratio(r["fwd_wire"], gather_theory), r["err"],
                max(per_tp[tp][k]["vocab"][name]["ms"] for k in range(tp)),
                max(per_tp[tp][k]["vocab"][name]["cpu_ms"] for k in range(tp)),
            ])
    report.table(
        f"2. Head + cross entropy per step: b*s={n_tok} tokens, V={VOCAB}, h={H}, per rank",
        ["method", "tp", "fwd collectives (loss)", "loss payload B", "loss wire B (ring)", "bwd collectives (head)",
         "head payload B", "head+loss wire B", "all-gather logits B (theory)", "loss wire / all-gather",
         "|err| vs unsharded", "fwd+bwd ms", "fwd+bwd cpu ms"],
        rows,
        notes=[
            "theory for gathering the logits: b*s*V*4*(tp-1)/tp bytes received per rank (ring all-gather).",
            "wire B (ring) converts each recorded collective to the bytes one rank sends with a ring algorithm: "
            "all-reduce 2(tp-1)/tp x payload, all-gather (tp-1) x local piece.",
            "the backward all-reduce of the head's input gradient (b*s*h*4 payload) is the same for both methods and is not "
            "part of the loss; the vocab-parallel loss sends only per-token statistics (row max, target logit, sum of exp).",
            "'vocab-parallel CE' is the path the strategy takes for F.cross_entropy on VocabParallelLogits; "
            "'all-gather logits + CE' uses the same sharded weight and megastrategy's gather_from_tensor_parallel_region.",
        ],
        raw=raw,
    )


# ======================================================================================
# section 3: Lightning step time
# ======================================================================================
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


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:  # pragma: no cover
        return "n/a"


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


def section_lightning(report: Report, steps: int, warmup: int, batch: int, repeats: int, timeout: float) -> None:
    base = {"steps": steps + warmup, "warmup": warmup}
    runs = [
        ("plain Lightning (default strategy)", 1, {"strategy": "plain", "batch_size": batch}),
        ("MegatronStrategy(tp=1)", 1, {"strategy": "megatron", "tp": 1, "batch_size": batch}),
        ("DDPStrategy, 2 processes", 2, {"strategy": "ddp", "batch_size": batch // 2}),
        ("MegatronStrategy(tp=2), 2 processes", 2, {"strategy": "megatron", "tp": 2, "batch_size": batch}),
    ]
    res = run_lightning_set(runs, base, repeats, timeout)
    plain = res["plain Lightning (default strategy)"]
    ddp = res["DDPStrategy, 2 processes"]
    rows = []
    for name, n, cfg in runs:
        r = res[name]
        global_batch = cfg["batch_size"] * (n if cfg["strategy"] == "ddp" else 1)
        rows.append([
            name, r["strategy_class"], n, f"{cfg['batch_size']} / {global_batch}", r["median_ms"],
            f"{fmt_num(r['p10_ms'])}-{fmt_num(r['p90_ms'])}", r["cpu_ms"], r["iteration_ms"],
            ratio(r["median_ms"], plain["median_ms"]), ratio(r["cpu_ms"], plain["cpu_ms"]),
            "-" if n == 1 else fmt_num(ratio(r["median_ms"], ddp["median_ms"])),
            loss_gap(r["losses"], plain["losses"]), ", ".join(fmt_num(m) for m in r["all_medians_ms"]),
            f"{r['loadavg_before']} -> {r['loadavg_after']}",
        ])
    report.table(
        f"3. Lightning training step, GPT example (d_model={GPT_CFG['d_model']}, {GPT_CFG['n_layer']} layers, "
        f"heads={GPT_CFG['n_head']}, seq={GPT_CFG['seq_len']}, char vocab), median over {steps} steps after {warmup} warm-up",
        ["run", "strategy class", "procs", "batch per rank / global", "median step ms", "p10-p90 ms", "cpu ms/step",
         "median iteration ms", "step vs plain", "cpu vs plain", "step vs DDP-2", "max rel. loss diff vs plain",
         "all medians ms", "load avg before -> after"],
        rows,
        notes=LIGHTNING_NOTES + [
            f"2 processes on {os.cpu_count()} CPU cores (one thread each): the tp=2 and DDP rows compare the strategies on "
            "the same global batch; this is overhead, NOT a speed-up measurement. TP=2 halves each rank's matmul work but "
            "adds 4 all-reduces per layer, the vocab-parallel embedding/loss traffic and a batch broadcast; DDP halves the "
            "batch per rank and adds one gradient all-reduce.",
            "load avg: the machine's 1/5/15-minute load before and after the run; above the core count other processes "
            "competed for the CPUs and wall-clock times are inflated (cpu ms is less affected).",
        ],
        raw={k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in res.items()},
    )


# ======================================================================================
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lightning-worker", help=argparse.SUPPRESS)
    p.add_argument("--tps", default="1,2,4", help="tensor-parallel sizes for sections 1-2 (default 1,2,4)")
    p.add_argument("--vocab-tps", default="2", help="tensor-parallel sizes for the head + loss measurement (default 2)")
    p.add_argument("--iters", type=int, default=20, help="timed forward+backward iterations per layer")
    p.add_argument("--steps", type=int, default=30, help="measured Lightning steps")
    p.add_argument("--warmup", type=int, default=10, help="Lightning warm-up steps (not measured)")
    p.add_argument("--batch", type=int, default=8, help="global batch for the Lightning runs")
    p.add_argument("--repeats", type=int, default=2, help="runs per Lightning configuration (best median kept)")
    p.add_argument("--skip-comm", action="store_true")
    p.add_argument("--skip-lightning", action="store_true")
    p.add_argument("--timeout", type=float, default=300, help="hard limit per launched job, seconds")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.lightning_worker:
        lightning_worker(json.loads(args.lightning_worker))
        return
    torch.set_num_threads(1)
    tps = [int(t) for t in args.tps.split(",")]
    vocab_tps = [int(t) for t in args.vocab_tps.split(",") if t]
    config = {"layer": {"h": H, "heads": HEADS, "ffn": FFN, "b": B, "s": S, "dtype": "fp32"}, "vocab": VOCAB,
              "tps": tps, "vocab_tps": vocab_tps, "iters": args.iters, "lightning": {**GPT_CFG, "steps": args.steps, "warmup": args.warmup,
                                                            "global_batch": args.batch, "repeats": args.repeats}}
    report = Report("bench_tp", "megastrategy tensor-parallel benchmark (bench/bench_tp.py)", machine_info(), config)
    t0 = time.perf_counter()
    if not args.skip_comm:
        section_comm(report, tps, vocab_tps, args.iters, args.timeout)
    if not args.skip_lightning:
        section_lightning(report, args.steps, args.warmup, args.batch, args.repeats, args.timeout)
    js, md = report.save(args.out_dir)
    print(f"total {time.perf_counter() - t0:.0f}s; wrote {js} and {md}", flush=True)


if __name__ == "__main__":
    main()
