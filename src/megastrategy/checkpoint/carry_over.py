"""Which saved random streams a resume on ANOTHER layout can still continue.

On the same layout every rank gets its own saved streams back (:mod:`.resume`). On another
one a rank has no saved twin, but a stream still carries over when every saved rank it could
correspond to held the same state: then it does not matter which of them this rank continues.

* torch's CPU generator, Python's ``random``, NumPy's global generator (and CUDA's): carried
  when identical over the saved ranks of this rank's dp rank (dp unchanged) or over all saved
  ranks (dp changed). They diverge only when ranks draw differently (dropout on different
  pipeline stages, per-rank augmentation), and then start afresh.
* the model-parallel stream (:class:`~megastrategy.layers.random.ModelParallelRNGTracker`) is
  per tensor-parallel rank and per stage's layers by design: never carried to another layout.
* the sampler's epoch-start state (what a ``RandomSampler`` and loader workers draw from):
  carried from the saved replica's data-loading rank of the same dp rank when dp is unchanged.
  A ``DistributedSampler`` (what Lightning gives the strategy) is seeded by epoch and needs none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["CarryOver", "carry_over", "SHARED_STREAMS"]

#: streams that may be identical on every rank, in the order they are reported
SHARED_STREAMS = ("torch", "python", "numpy", "cuda")


@dataclass
class CarryOver:
    """What one rank takes from the saved ranks' states on a layout change."""

    rng: dict[str, Any] = field(default_factory=dict)
    epoch_start_rng: Optional[list] = None
    kept: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)


def carry_over(saved: list[dict[str, Any]], *, dp_rank: int, same_dp: bool) -> CarryOver:
    """``saved``: every saved rank's ``rank_state`` (with its ``dp_rank`` and ``data_source``)."""
    peers = [s for s in saved if not same_dp or s.get("dp_rank") == dp_rank]
    result = CarryOver()
    if not peers or any("dp_rank" not in s for s in saved):  # written before layouts were recorded
        result.fresh = [*SHARED_STREAMS[:3], "model_parallel", "sampler"]
        return result
    names = [n for n in SHARED_STREAMS if any(n in s.get("rng", {}) for s in peers)]
    for name in names:
        values = [s.get("rng", {}).get(name) for s in peers]
        if all(v is not None and _same(v, values[0]) for v in values):
            result.rng[name] = values[0]
            result.kept.append(name)
        else:
            result.fresh.append(name)
    if any("model_parallel" in s.get("rng", {}) for s in peers):
        result.fresh.append("model_parallel")
    source = next((s for s in peers if s.get("data_source")), None)
    if same_dp and source is not None:
        result.epoch_start_rng = source.get("epoch_start_rng")
        result.kept.append("sampler")
    else:
        result.fresh.append("sampler")
    return result


def _same(a: Any, b: Any) -> bool:
    """Equality of nested states made of tensors, numbers, strings, tuples, lists and dicts."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
