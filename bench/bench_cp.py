"""Context-parallel benchmark: activation memory per rank, ring traffic against its minimum,
causal load balance and step time, for a causal decoder (tiny Hugging Face Llama, GQA).

    OMP_NUM_THREADS=1 python bench/bench_cp.py                         # seq 1k and 4k, cp 1, 2, 4
    python bench/bench_cp.py --seqs 1024,4096,16384 --cps 1,2,4        # a machine with >= 4 free cores

Sections (real processes, gloo over 127.0.0.1, one thread each):

1. Causal load balance (arithmetic only): attention score entries each rank computes (chunk
   pairs the mask hides are skipped), balanced layout against a contiguous split, max/min.
2. Per (seq, cp): one forward + backward of the model on a split batch.
   * activation memory per rank: bytes of the tensors autograd saves for backward (distinct
     storages), against the unsplit model on one process (ideal: 1/cp);
   * ring bytes sent per layer, forward and backward, against the ring minimum: (cp−1)/cp of
     K and V per layer forward; backward twice that (K and V again, dK and dV back);
   * step time against the unsplit model on one process (meaningless beyond the free cores);
   * |loss − one-device loss|, a correctness check.

Nothing here is asserted; the numbers are printed side by side and written to
bench/results/bench_cp.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets OMP_NUM_THREADS=1 before torch; puts src/ on sys.path)

import torch  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, BATCH = 64, 4, 2, 2, 256, 1


def build_model(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=seq,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def make_batch(seq: int):
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def saved_bytes(run) -> tuple[object, int]:
    """``run()``'s result and the bytes of the distinct storages autograd saved during it."""
    storages: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return result, sum(storages.values())


def timed_steps(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_device(rank: int, world: int, seq: int, steps: int, warmup: int) -> dict:
    model, batch = build_model(seq), make_batch(seq)
    out, memory = saved_bytes(lambda: model(**batch))
    out.loss.backward()
    seconds = timed_steps(lambda: model(**batch).loss.backward(), steps, warmup)
    return {"loss": out.loss.item(), "saved_bytes": memory, "step_s": seconds}


def split_step(context, model, batch):
    local = context.transform_microbatch(batch, training=True)
    with context.forward_context(local):
        out = model(**local)
    return out


def cp_worker(rank: int, world: int, seq: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    from megastrategy.context import ContextParallel

    model, batch = build_model(seq), make_batch(seq)
    context = ContextParallel(dist.group.WORLD)
    context.apply(model)
    out, memory = saved_bytes(lambda: split_step(context, model, batch))
    forward_bytes = context.ring.bytes_sent
    out.loss.backward()
    backward_bytes = context.ring.bytes_sent - forward_bytes
    seconds = timed_steps(lambda: split_step(context, model, batch).loss.backward(), steps, warmup)
    context.teardown()
    return {"loss": out.loss.item(), "saved_bytes": memory, "step_s": seconds,
            "fwd_bytes_per_layer": forward_bytes / LAYERS, "bwd_bytes_per_layer": backward_bytes / LAYERS}


def ring_minimum_per_layer(seq: int, cp: int) -> float:
    """(cp−1)/cp of the whole K and V (fp32), which every rank must receive once per direction."""
    kv_bytes = 2 * BATCH * KV_HEADS * seq * (HIDDEN // HEADS) * 4
    return kv_bytes * (cp - 1) / cp


def computed_entries(layout_kind: str, seq: int, cp: int) -> list[int]:
    """Score entries each rank computes for causal attention: chunk pairs the mask hides are skipped."""
    from megastrategy.context.layout import SequenceLayout
    from megastrategy.context.masks import MaskRule, pair_mask

    layout, rule = SequenceLayout(layout_kind, seq, cp), MaskRule(causal=True)
    per_rank = []
    for rank in range(cp):
        pairs = [(q, k) for src in range(cp) for q in layout.chunks(rank) for k in layout.chunks(src)]
        per_rank.append(sum(q.length * k.length for q, k in pairs if not pair_mask(q, k, rule)[0]))
    return per_rank


def section_balance(report, seqs, cps) -> None:
    rows = []
    for seq in seqs:
        for cp in (c for c in cps if c > 1):
            balanced, contiguous = computed_entries("balanced", seq, cp), computed_entries("contiguous", seq, cp)
            rows.append([seq, cp, max(balanced) / min(balanced), max(contiguous) / min(contiguous),
                         sum(balanced) / (seq * (seq + 1) / 2)])
    report.table("Causal load balance (attention score entries per rank)",
                 ["seq", "cp", "balanced max/min", "contiguous max/min", "computed / causal minimum"], rows,
                 notes=["computed/minimum > 1: diagonal chunk pairs are computed whole and masked."])


def section_runs(report, seqs, cps, steps, warmup, timeout) -> None:
    rows, raw = [], {}
    for seq in seqs:
        base = common.spawn(one_device, 1, seq, steps, warmup, timeout=timeout)[0]
        raw[f"{seq}/1"] = base
        rows.append([seq, 1, 1.0, 1.0, "-", "-", base["step_s"], 1.0, 0.0])
        for cp in (c for c in cps if c > 1):
            ranks = common.spawn(cp_worker, cp, seq, steps, warmup, timeout=timeout)
            raw[f"{seq}/{cp}"] = ranks
            minimum = ring_minimum_per_layer(seq, cp)
            memory = max(r["saved_bytes"] for r in ranks) / base["saved_bytes"]
            step = max(r["step_s"] for r in ranks)
            rows.append([seq, cp, memory, 1 / cp, max(r["fwd_bytes_per_layer"] for r in ranks) / minimum,
                         max(r["bwd_bytes_per_layer"] for r in ranks) / (2 * minimum), step, step / base["step_s"],
                         max(abs(r["loss"] - base["loss"]) for r in ranks)])
    report.table("Split forward + backward against one device",
                 ["seq", "cp", "activation mem / cp=1", "ideal", "fwd ring bytes / min", "bwd ring bytes / min",
                  "step s", "step / cp=1", "|loss - cp=1|"], rows, raw=raw,
                 notes=["activation memory: bytes autograd saves for backward (distinct storages), the largest rank.",
                        "ring minimum per layer: (cp-1)/cp of K and V forward; twice that backward (K,V in, dK,dV "
                        "out). The dK/dV accumulator makes cp hops, one more than K,V: (2cp-1)/(2cp-2) of the minimum.",
                        "step time: the slowest rank; with more processes than free cores it measures contention."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1024,4096")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    seqs, cps = [int(s) for s in args.seqs.split(",")], [int(c) for c in args.cps.split(",")]
    report = common.Report("bench_cp", "Context parallelism (ring attention)", common.machine_info(), vars(args))
    section_balance(report, seqs, cps)
    section_runs(report, seqs, cps, args.steps, args.warmup, args.timeout)
    print("written:", *report.save(args.out_dir))


if __name__ == "__main__":
    main()
