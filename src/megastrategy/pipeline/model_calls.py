"""The user's top-level model calls under pipeline parallelism: record them on the last stage,
answer them from the relayed record elsewhere.

A pipeline stage ends the user's forward at the stage cut (:class:`~.stage.StageBoundary`), so on
every stage but the last the lines of the user's step after the model call cannot run while the
schedule runs. :class:`ModelCalls` wraps ``forward`` of the modules through which a step reaches the
layer stack (the LightningModule and the stack's ancestors) and of the modules registered after the
stack. The outermost such call made by a step is a *model call*; the step runner sets the mode:

* ``pass``: calls run unchanged (a stage's share of the forward, and any call outside a step);
* ``record``: calls run and their outputs are kept (the last stage's run of a microbatch);
* ``replay``: calls return the outputs recorded on the last stage, in call order, computing
  nothing, so the rest of the user's step runs with what one device computed.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["ModelCalls"]


class _CallThrough:
    """A module's ``forward`` routed through :class:`ModelCalls` (a class, not a closure, so that
    deep copies rebind it); it keeps the forward's name and signature for code that inspects them."""

    def __init__(self, calls: "ModelCalls", forward: Any, name: str) -> None:
        self.calls, self.forward, self.name = calls, forward, name
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.calls.call(self, args, kwargs)


class ModelCalls:
    """Routes the outermost calls of ``modules`` (see the module docstring)."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self._depth = 0
        self._mode = "pass"
        self._record: list[Any] = []
        self._replay: list[Any] = []
        for name, module in modules:
            current = module.__dict__.get("forward")
            if isinstance(current, _CallThrough):  # a runner built again for the same stage
                current.calls = self
            else:
                module.forward = _CallThrough(self, module.forward, name or type(module).__name__)

    @contextmanager
    def recording(self) -> Iterator[list]:
        """Run calls and collect the outputs of the outermost ones into the yielded list."""
        self._mode, self._record = "record", []
        try:
            yield self._record
        finally:
            self._mode = "pass"

    @contextmanager
    def replaying(self, outputs: list, step_name: str) -> Iterator[None]:
        """Answer the outermost calls with ``outputs`` in order; every one must be used."""
        self._mode, self._replay = "replay", list(outputs)
        try:
            yield
            if self._replay:
                raise MegatronConfigError(
                    f"{step_name} made {len(outputs) - len(self._replay)} model call(s) on this pipeline stage but "
                    f"{len(outputs)} on the last stage; the step must call the model the same way on every rank."
                )
        finally:
            self._mode, self._replay = "pass", []

    def call(self, through: _CallThrough, args: tuple, kwargs: dict) -> Any:
        outermost = self._depth == 0
        if outermost and self._mode == "replay":
            if not self._replay:
                raise MegatronConfigError(
                    f"{through.name} was called more often in this step than on the last pipeline stage; "
                    "the step must call the model the same way on every rank."
                )
            return self._replay.pop(0)
        self._depth += 1
        try:
            out = through.forward(*args, **kwargs)
        finally:
            self._depth -= 1
        if outermost and self._mode == "record":
            self._record.append(out)
        return out
