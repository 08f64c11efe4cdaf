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

Results are printed and written to bench/results/bench_tp.{json,md}. Shared helpers (machine
info, launchers, tables) are in ``common.py``, the Lightning runs in ``lightning_runs.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Report, fmt_num, machine_info, ratio, spawn  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch)
from lightning_runs import GPT_CFG, LIGHTNING_NOTES, loss_gap, run_lightning_set  # noqa: E402

import torch  # noqa: E402


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
# section 3: Lightning step time (the runs themselves: lightning_runs.py)
# ======================================================================================
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
