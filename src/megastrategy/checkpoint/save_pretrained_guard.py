"""Refuse Hugging Face ``save_pretrained()`` on a model this rank holds only a share of.

Users save a fine-tuned model (or a PEFT adapter) with ``self.model.save_pretrained(dir)``, often
on rank 0 only. Under tensor or pipeline parallelism that rank holds shards of the weights or one
stage's layers, so the files would be incomplete or shaped wrong and nothing would say so until
``from_pretrained`` fails, or worse, loads them. The call is refused with what writes the whole
model instead."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_partial_save_pretrained", "sharding_of"]


def sharding_of(parallel_state: Any) -> str:
    """``"tp=2, pp=2"``: how the model is split over ranks ("" when every rank holds all of it)."""
    sizes = (("tp", parallel_state.tp_size), ("pp", parallel_state.pp_size), ("ep", parallel_state.ep_size))
    return ", ".join(f"{name}={size}" for name, size in sizes if size > 1)


def refuse_partial_save_pretrained(module: nn.Module, sharding: str) -> None:
    """Make ``save_pretrained`` of every Hugging Face (or PEFT) model in ``module`` raise."""
    if not sharding:
        return
    for name, m in module.named_modules():
        if callable(getattr(type(m), "save_pretrained", None)):
            m.save_pretrained = _refusal(name or type(m).__name__, sharding)


def _refusal(name: str, sharding: str) -> Callable[..., Any]:
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        raise MegatronConfigError(
            f"{name}.save_pretrained() with {sharding}: this rank holds only its share of the model, so the files "
            "would be incomplete. Write the whole model with trainer.strategy.export_hf('out_dir') (a collective: "
            "call it on every rank; from_pretrained loads the result), or save a checkpoint and run "
            "`megastrategy export CKPT OUT --strip model.`."
        )

    return save_pretrained
