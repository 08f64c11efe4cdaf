"""The user's top-level model calls under pipeline parallelism: record them on the last stage,
answer them from the relayed record elsewhere.

A pipeline stage ends the user's forward at the stage cut (:class:`~.stage.StageBoundary`), so on
every stage but the last the lines of the user's step after the model call cannot run while the
schedule runs. :class:`ModelCalls` wraps ``forward`` of the modules through which a step reaches the
layer stack (the LightningModule and the stack's ancestors) and of the modules registered after the
stack. The outermost such call made by a step is a *model call*; the step runner sets the mode:

* ``pass``: calls run unchanged (a stage's share of the forward); a call outside any step (a hook such
  as ``on_train_epoch_end`` running the model on a fixed sample) is refused, naming what works: a
  stage holds only its part of the model, so alone it failed at the first module it does not hold,
  with a misleading message about registration order;
* ``record``: calls run and their outputs are kept (the last stage's run of a microbatch);
* ``pause``: the call runs up to the stage cut, then the step pauses (:mod:`.suspended_step`)
  until the last stage's outputs are relayed; the call returns them, so the rest of the user's
  step runs with what one device computed, and its lines before the call ran once;
* ``replay``: calls return the outputs recorded on the last stage, in call order, computing nothing.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.stage import StageBoundary

__all__ = ["ModelCalls"]


class _CallThrough:
    """A module's ``forward`` routed through :class:`ModelCalls` (a class, not a closure, so that
    deep copies rebind it); it keeps the forward's name and signature for code that inspects them."""

    def __init__(self, calls: "ModelCalls", forward: Any, name: str, holds_stack: bool = False) -> None:
        self.calls, self.forward, self.name, self.holds_stack = calls, forward, name, holds_stack
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.calls.call(self, args, kwargs)


class ModelCalls:
    """Routes the outermost calls of ``modules`` (see the module docstring). The mode is per
    thread: a paused step (:mod:`.suspended_step`) keeps its own while the schedule goes on."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], stack_path: str = "",
                 in_step: Callable[[], bool] = lambda: True) -> None:
        """``stack_path``: where the layer stack is; the modules named on its path hold it, and a
        step may pass through them once per microbatch (see :meth:`_refuse_second_pass`).
        ``in_step()``: whether the schedule is running a step on this stage now."""
        self._local = threading.local()
        self._in_step = in_step
        self._stack_path, self._holders = stack_path, []  # the modules a step reaches the stack through
        for name, module in modules:
            holds = bool(stack_path) and (name == "" or stack_path == name or stack_path.startswith(name + "."))
            if holds:
                self._holders.append(name or "the LightningModule")
            current = module.__dict__.get("forward")
            if isinstance(current, _CallThrough):  # a runner built again for the same stage
                current.calls, current.holds_stack = self, holds
            else:
                module.forward = _CallThrough(self, module.forward, name or type(module).__name__, holds)

    def __deepcopy__(self, memo: dict) -> "ModelCalls":
        """Shared, not copied: a deep copy of a stage's module (an ``AveragedModel`` made for an EMA,
        the copy ``StochasticWeightAveraging`` averages into) routes its calls through the same
        per-thread modes, and a ``threading.local`` cannot be copied anyway."""
        return self

    def _state(self) -> Any:
        state = self._local
        if not hasattr(state, "mode"):
            state.depth, state.mode, state.record, state.replay, state.pause = 0, "pass", [], [], None
            state.passes = 0
        return state

    @contextmanager
    def recording(self) -> Iterator[list]:
        """Run calls and collect the outputs of the outermost ones into the yielded list."""
        state = self._state()
        state.mode, state.record, state.passes = "record", [], 0
        try:
            yield state.record
        finally:
            state.mode = "pass"

    @contextmanager
    def replaying(self, outputs: list, step_name: str) -> Iterator[None]:
        """Answer the outermost calls with ``outputs`` in order; every one must be used."""
        state = self._state()
        state.mode, state.replay = "replay", list(outputs)
        try:
            yield
            self._check_used(state, step_name)
        finally:
            state.mode, state.replay = "pass", []

    @contextmanager
    def pausing(self, pause: Callable[[Any], list], step_name: str) -> Iterator[None]:
        """Run the first outermost call up to the stage cut, then ``pause(activation)`` until the
        relayed outputs arrive: the first answers that call, the rest answer later calls."""
        state = self._state()
        state.mode, state.pause, state.replay = "pause", pause, []
        try:
            yield
            if state.mode == "replay":
                self._check_used(state, step_name)
        finally:
            state.mode, state.pause, state.replay = "pass", None, []

    @staticmethod
    def _check_used(state: Any, step_name: str) -> None:
        if state.replay:
            raise MegatronConfigError(
                f"{step_name} made fewer model calls on this pipeline stage than on the last stage "
                f"({len(state.replay)} left unused); the step must call the model the same way on every rank."
            )

    @staticmethod
    def _refuse_second_pass(state: Any, through: _CallThrough) -> None:
        """A microbatch goes through the stages once; a second pass through the stack in the same
        step (two batches of a dict of loaders, a contrastive pair) would need the first stage's
        layers here on the last stage. Said before the first module of that pass fails obscurely."""
        state.passes += 1
        if state.passes > 1:
            raise MegatronConfigError(
                f"the step called {through.name} (which holds the pipeline layer stack) {state.passes} times for one "
                "microbatch; under pipeline parallelism each microbatch passes through the stages once, so a step "
                "may run the layer stack once (modules after it, such as a head, may still be called separately). "
                "Join the inputs into one call (torch.cat the batches along dim 0 and split the output), or use "
                "pp=1 (tensor and data parallelism run such a step)."
            )

    def refuse_stack_outside_calls(self) -> None:
        """Called as a chunk's first block starts: a step (recording, or pausing at the stage cut) that
        runs the blocks itself, outside a call of the modules holding them (its own loop over
        ``self.blocks`` in a method other than ``forward``), has no model call to pause at or record: the
        first stage crashed with a KeyError and the last blamed the registration order. Said here."""
        state = self._state()
        if state.depth == 0 and state.mode in ("record", "pause"):
            raise MegatronConfigError(_stack_outside_calls(self._stack_path, self._holders))

    def call(self, through: _CallThrough, args: tuple, kwargs: dict) -> Any:
        state = self._state()
        outermost = state.depth == 0
        if outermost and state.mode == "replay":
            if not state.replay:
                raise MegatronConfigError(
                    f"{through.name} was called more often in this step than on the last pipeline stage; "
                    "the step must call the model the same way on every rank."
                )
            return state.replay.pop(0)
        if outermost and state.mode == "record" and through.holds_stack:
            self._refuse_second_pass(state, through)
        if outermost and state.mode == "pass" and not self._in_step():
            raise MegatronConfigError(_outside_step(through.name))
        state.depth += 1
        try:
            out = through.forward(*args, **kwargs)
        except StageBoundary as boundary:
            if not (outermost and state.mode == "pause"):
                raise
            relayed = state.pause(boundary.output)
            state.mode, state.replay = "replay", list(relayed[1:])
            return relayed[0]
        finally:
            state.depth -= 1
        if outermost and state.mode == "record":
            state.record.append(out)
        return out


def _stack_outside_calls(stack_path: str, holders: list[str]) -> str:
    return (
        f"the step ran the blocks of {stack_path!r} itself, not inside a call of a module holding them "
        f"({', '.join(holders)}): e.g. a loop over the blocks in a method other than forward. Under pipeline "
        "parallelism each stage runs its blocks within one model call per microbatch, which it pauses at the stage "
        "cut and answers with the last stage's output, so the step must reach the blocks through forward: move the "
        "loop into forward and call self(...) (or self.model(...)) once per microbatch; to encode two views, "
        "torch.cat them along dim 0 into one call and split the output. Or use pp=1 (tensor and data parallelism "
        "run such a step)."
    )


def _outside_step(name: str) -> str:
    return (
        f"{name}(...) was called outside a training/validation/test/predict step (in a hook such as "
        "on_train_epoch_end or on_validation_epoch_end) under pipeline parallelism: each stage holds only its "
        "part of the model and runs it when the schedule hands it a microbatch, so a call outside a step cannot "
        "run (one device runs it whole). What works: compute it inside a step, e.g. a second validation "
        "dataloader holding the sample (validation_step(batch, batch_idx, dataloader_idx)) and self.log its "
        "result, or trainer.predict after fit; or pp=1 (tensor and data parallelism run such a call)."
    )
