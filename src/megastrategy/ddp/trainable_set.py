"""Parameters frozen or unfrozen after the gradient buffer was built.

The buffer holds the parameters that required grad when ``fit`` set it up. Fine-tuning code
changes that later: Lightning's ``BackboneFinetuning`` freezes the backbone in ``on_fit_start``
(after the strategy's ``setup``) and unfreezes it at a chosen epoch, and users unfreeze layers in
``on_train_epoch_start``. A parameter unfrozen later got a plain ``.grad``, never reduced over data
parallelism nor counted by clipping; one frozen later kept a zero gradient view, so the optimizer
still applied weight decay and momentum to it, where DDP's optimizer skips a parameter without a
gradient. :func:`trainable_change` tells the buffer's owner when to rebuild it (between optimizer
steps), and :func:`refuse_change` says why it cannot when the optimizer holds pieces of the buffer.
"""
from __future__ import annotations

from typing import AbstractSet, Iterable

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["trainable_change", "refuse_change"]


def trainable_change(named: Iterable[tuple[str, nn.Parameter]], buffered: AbstractSet[int]) -> tuple[list[str], list[str]]:
    """``(unfrozen, frozen)``: names of the parameters among ``named`` (outside ``buffered`` ids: now
    requiring grad; inside: no longer) whose ``requires_grad`` differs from when the buffer was built."""
    unfrozen, frozen = [], []
    for name, p in named:
        if p.requires_grad and id(p) not in buffered:
            unfrozen.append(name)
        elif not p.requires_grad and id(p) in buffered:
            frozen.append(name)
    return unfrozen, frozen


def refuse_change(unfrozen: list[str], frozen: list[str], why: str) -> None:
    def shown(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    changed = "; ".join(f"{what}: {shown(names)}" for what, names in (("unfrozen", unfrozen), ("frozen", frozen)) if names)
    raise MegatronConfigError(
        f"parameters changed requires_grad after fit started ({changed}), and {why}. Set requires_grad before "
        "trainer.fit (in __init__ or configure_model) and keep it for the run, or change it only at an optimizer "
        "step boundary without use_distributed_optimizer or half-precision parameters (bf16-true)."
    )
