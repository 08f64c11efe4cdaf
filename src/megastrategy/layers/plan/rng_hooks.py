"""Attention-dropout regions: while a region's owner runs its forward, dropout draws from the
per-TP-rank RNG stream, so that each rank's local heads get independent masks."""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["RNGRegionHooks"]


class RNGRegionHooks:
    """Enter ``tracker.fork()`` at the owner's forward pre-hook, leave it at the pre-hook of
    ``until`` (if any) or when the owner's forward ends (also on an exception)."""

    def __init__(self, tracker, dropout_p: str) -> None:
        self.tracker = tracker
        self.dropout_p = dropout_p
        self._open: list[Any] = []

    def _p(self, module: nn.Module) -> float:
        value: Any = module
        for part in self.dropout_p.split("."):
            value = getattr(value, part, 0.0)
        try:
            return float(value)
        except (TypeError, ValueError):
            return 0.0

    def enter(self, module: nn.Module, args: Any) -> None:
        if module.training and self._p(module) > 0.0:
            cm = self.tracker.fork()
            cm.__enter__()
            self._open.append(cm)
        else:
            self._open.append(None)

    def leave_early(self, module: nn.Module, args: Any) -> None:
        if self._open and self._open[-1] is not None:
            cm, self._open[-1] = self._open[-1], None
            cm.__exit__(None, None, None)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        cm = self._open.pop() if self._open else None
        if cm is not None:
            cm.__exit__(None, None, None)
