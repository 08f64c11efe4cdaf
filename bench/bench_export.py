"""Peak memory of exporting a sharded checkpoint: whole-model consolidation against streaming.

A model of stacked linear layers (about 600 MB in fp32, 12 tensors of 48 MB plus small ones) is
saved as a sharded checkpoint. Each export then runs in a fresh process, and its peak resident
memory above the process's own after its imports (``VmHWM`` reset through ``/proc/self/clear_refs``)
is reported side by side with the floor the
streaming path aims for: one output shard plus the largest tensor. The model is also compared
with one rank's activation memory for a batch of 1 x 32 tokens (measured with saved-tensor
hooks), since the issue asks for a model at least 20 times that.

    python bench/bench_export.py [--hidden 2048] [--layers 12] [--shard-mb 64]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401  (sys.path, OMP_NUM_THREADS)
import torch
from torch import nn

_CHILD = r"""
import json, sys
sys.path.insert(0, {src!r})
import torch
from megastrategy.checkpoint import consolidate
from megastrategy.checkpoint.sharded import MODEL
from megastrategy.checkpoint.streaming import write_safetensors_shards

def status(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS, after the imports
base = status("VmRSS")
mode, ckpt, out, shard = sys.argv[1:5]
if mode == "consolidate":
    torch.save(consolidate(ckpt), out + ".pt")
elif mode == "stream":
    write_safetensors_shards(ckpt, out, prefix=MODEL, max_shard_bytes=int(shard))
print(json.dumps({{"peak_kb": status("VmHWM") - base}}))
"""


def build(hidden: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, 3 * hidden), nn.GELU(), nn.Linear(3 * hidden, hidden))
                           for _ in range(layers // 2)])


def activation_bytes(model: nn.Module, hidden: int, tokens: int) -> int:
    saved, weights = [], {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:  # activations only: the weights are counted as the model
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(1, tokens, hidden, requires_grad=True)).sum().backward()
    return sum(saved)


def peak_mb(mode: str, ckpt: Path, out: Path, shard: int) -> float:
    code = _CHILD.format(src=str(common.REPO / "src"))
    done = subprocess.run([sys.executable, "-c", code, mode, str(ckpt), str(out), str(shard)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_kb"] / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--shard-mb", type=int, default=64)
    args = p.parse_args()
    from megastrategy.checkpoint.sharded import save_sharded

    torch.manual_seed(0)
    model = build(args.hidden, args.layers)
    model_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    largest_mb = max(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    act_mb = activation_bytes(model, args.hidden, 32) / 2**20
    shard = args.shard_mb * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        save_sharded(ckpt, module=model, is_coordinator=True, barrier=lambda: None)
        del model
        full = peak_mb("consolidate", ckpt, Path(tmp) / "full", shard)
        stream = peak_mb("stream", ckpt, Path(tmp) / "stream", shard)
    print(common.machine_line(common.machine_info()))
    print(f"model {model_mb:.0f} MB ({model_mb / act_mb:.0f}x one rank's activations for 1x32 tokens, {act_mb:.1f} MB); "
          f"largest tensor {largest_mb:.0f} MB; shard limit {args.shard_mb} MB")
    floor = args.shard_mb + largest_mb
    print(common.text_table(
        ["export", "peak MB above the idle process", "x model", "x (shard + largest tensor)"],
        [["consolidate (whole model)", f"{full:.0f}", f"{full / model_mb:.2f}", f"{full / floor:.2f}"],
         ["streaming safetensors shards", f"{stream:.0f}", f"{stream / model_mb:.2f}", f"{stream / floor:.2f}"]]))


if __name__ == "__main__":
    main()
