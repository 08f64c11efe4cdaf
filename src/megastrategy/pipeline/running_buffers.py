"""Refuse a module that updates a buffer in its training forward when pp splits the batch.

A running mean or a count kept in a buffer (a user's normalizer, ``InstanceNorm(track_running_stats=
True)``; BatchNorm is refused by class in setup, :mod:`.batch_statistics`) is updated by each forward:
under ``pp > 1`` once per microbatch, from 1/``num_microbatches`` of the batch, where one device updates it
once from the whole batch. Every later forward then reads other values (a running mean at pp2: 22.788
against one device's 22.653 at the first step, silently). Such updates are only seen by running the
step, so the first training step of a fit compares the stage's buffers before and after and refuses,
naming the buffer. Buffers of this package's and Transformer Engine's modules (fp8 scaling state,
updated per microbatch as Megatron does) are not counted.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from megastrategy.component import StepInfo
from megastrategy.errors import MegatronConfigError

__all__ = ["RunningBuffers"]

_OWN = ("megastrategy.", "transformer_engine.")


def _user_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    found = {}
    for name, m in module.named_modules():
        if type(m).__module__.startswith(_OWN):
            continue
        for b_name, b in m.named_buffers(prefix=name, recurse=False):
            if b is not None and not b.is_meta:
                found[b_name] = b
    return found


class RunningBuffers:
    """``step(module, step)`` around the first pipelined training step of a fit (see the module docstring)."""

    def __init__(self, pp: int) -> None:
        self.pp, self._checked = pp, False

    @contextmanager
    def step(self, module: nn.Module, step: StepInfo) -> Iterator[None]:
        if self._checked or not step.training or step.num_microbatches <= 1:
            yield
            return
        before = {n: b.detach().clone() for n, b in _user_buffers(module).items()}
        yield
        self._checked = True
        now = _user_buffers(module)
        changed = next((n for n, b in before.items() if n in now and not torch.equal(b, now[n])), None)
        if changed is not None:
            raise MegatronConfigError(
                f"pp={self.pp} with num_microbatches={step.num_microbatches}: the buffer {changed!r} changed during "
                f"the training step: a module that updates a buffer in its forward (a running mean or a count, as "
                f"BatchNorm keeps) does so once per microbatch on its pipeline stage, from 1/{step.num_microbatches} "
                "of the batch, where one device updates it once from the whole batch, so every later step would "
                "differ silently from one device's. Pass num_microbatches=1 (each microbatch is the whole batch), or "
                "use tensor/data parallelism instead of pp for this model.")
