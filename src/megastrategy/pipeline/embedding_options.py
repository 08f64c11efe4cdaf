"""Refuse ``nn.Embedding`` options whose effect depends on the whole batch or on one copy of the weight,
when pp splits the batch or the weight.

* ``scale_grad_by_freq=True`` divides each row's gradient by how often the row occurs in the batch the
  embedding sees; a pipeline stage sees microbatches, so the counts are a microbatch's (pp2: 10.2775
  against one device's 10.2807 at the second step, silently), as BatchNorm's statistics would be.
* ``max_norm`` renormalizes the rows it looks up, in place, on the stage that holds the embedding; a
  head tied to it (GPT-2's, the hand-written GPT's) is a copy on the last stage, kept equal by the
  gradient exchange but never renormalized, so the head reads other weights than one device's (pp2:
  14.74 against 12.86 at the first step, silently). Untied, the renormalization happens before each use
  as on one device.

Refused in setup, naming the embedding and what works instead.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_embedding_options"]


def _tied_elsewhere(module: nn.Module, name: str, weight: nn.Parameter) -> Optional[str]:
    """Another module holding ``weight`` (a tied head), if any."""
    for other, p in module.named_parameters(remove_duplicate=False):
        if p is weight and not other.startswith(name + "."):
            return other.rpartition(".")[0]
    return None


def refuse_embedding_options(module: nn.Module, pp: int, num_microbatches: int) -> None:
    """Raise for an embedding whose ``scale_grad_by_freq`` would count a microbatch, or whose ``max_norm``
    would renormalize one of two tied copies."""
    for name, m in module.named_modules():
        if not isinstance(m, nn.Embedding):
            continue
        if m.scale_grad_by_freq and num_microbatches > 1:
            raise MegatronConfigError(
                f"pp={pp} with num_microbatches={num_microbatches}: {name!r} is nn.Embedding(scale_grad_by_freq=True), "
                "which divides each row's gradient by its count in the batch it sees, and pipeline stages see "
                f"microbatches of 1/{num_microbatches} of the batch, so every step would differ silently from one "
                "device's. Pass num_microbatches=1 (each microbatch is the whole batch), scale_grad_by_freq=False, "
                "or use tensor/data parallelism instead of pp.")
        tied = _tied_elsewhere(module, name, m.weight) if m.max_norm is not None else None
        if tied is not None:
            raise MegatronConfigError(
                f"pp={pp}: {name!r} is nn.Embedding(max_norm={m.max_norm}) and its weight is tied to {tied!r}: the "
                "embedding renormalizes the rows it looks up in place on its pipeline stage, and the tied copy on "
                "another stage is never renormalized, so it would read other weights than one device's, silently. "
                "Untie them (give the head its own weight), pass max_norm=None, or use pp=1.")
