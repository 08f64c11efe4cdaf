"""The one step path: run a Lightning step (training, validation, test, predict) over microbatches.

Every layout goes through :class:`StepRunner`. Without a pipeline the rank holds the one and
only stage, so a step is a one-stage, one-microbatch schedule: forward, then (training) the
backward through Lightning's own ``backward`` (its hooks and loss scaling included). With
``pp > 1`` the batch is split into microbatches and this rank's schedule runs them. The user's
step runs whole on every rank, as on one device: the last stage records what its model calls
return (:mod:`.model_calls`) and relays it to the other stages after the schedule
(:mod:`.output_relay`); there each microbatch's step paused at its model call
(:mod:`.suspended_step`) goes on with the relayed value, computing nothing, so every line after the forward (``self.outputs``,
torchmetrics updates, ``self.log``, returned dicts) runs with one device's values. Per-microbatch
``self.log`` calls are combined by their ``reduce_fx`` (:mod:`.log_relay`), the step outputs are
joined into the batch's (:mod:`.step_output`). Lightning's backward hooks (``on_before_backward(loss)``,
``on_after_backward``) then run once for the step, as one device runs them once per batch: after the
schedule, when the whole batch's loss is known on every stage and the stage's gradients are complete.

The components (:mod:`megastrategy.component`) see the same protocol in both cases:
``begin_step``, per microbatch ``forward_context``/``on_forward``/``on_backward``, ``end_step``.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from megastrategy.batch_tree import flatten_batch
from megastrategy.component import Component, SetupContext, StepInfo, overrides
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.executor import LocalCommunicator, PipelineExecutor
from megastrategy.pipeline.local_loss_terms import refuse_local_loss_terms
from megastrategy.pipeline.log_relay import capturing_logs, metric_paths, replay_logs
from megastrategy.pipeline.model_calls import ModelCalls
from megastrategy.pipeline.output_relay import OutputRelay
from megastrategy.pipeline.running_buffers import RunningBuffers
from megastrategy.pipeline.schedule_choice import microbatches_for, schedule_placement, training_steps
from megastrategy.rank_zero import log_on_rank_zero
from megastrategy.pipeline.schedules import forward_only_steps
from megastrategy.pipeline.stage import PipelineStage, StageBoundary, iter_microbatches
from megastrategy.pipeline.step_output import join_step_outputs
from megastrategy.pipeline.suspended_step import StepThreads, SuspendedStep
from megastrategy.pipeline.summed_losses import SummedLosses
from megastrategy.pipeline.user_checkpoint import UserCheckpoints
from megastrategy.pipeline.token_means import TokenMeans

__all__ = ["StepRunner"]

_log = logging.getLogger(__name__)

LightningBackward = Callable[[torch.Tensor], None]
BackwardHooks = Callable[[torch.Tensor], None]  # Lightning's before/after-backward hooks for a loss


class StepRunner:
    """Runs the user's step functions through this rank's schedule (see the module docstring)."""

    def __init__(
        self,
        *,
        executor: PipelineExecutor,
        components: Sequence[Component],
        stage: Optional[PipelineStage] = None,
        num_microbatches: int = 1,
        relay: Optional[OutputRelay] = None,
        device: Optional[torch.device] = None,
        schedule: str = "1f1b",
        token_means: Optional[TokenMeans] = None,
    ) -> None:
        self.executor, self.stage, self.device = executor, stage, device
        self.schedule = schedule if stage is not None else "1f1b"  # one stage: Lightning's own backward
        self.num_microbatches = num_microbatches if stage is not None else 1
        self.relay = relay
        self.calls = (ModelCalls(stage.call_modules, stage.stack_path, lambda: stage.active_chunk is not None)
                      if stage is not None else None)
        if stage is not None:
            stage.on_stack_entry = self.calls.refuse_stack_outside_calls
        self._running_buffers = RunningBuffers(executor.pp_size)
        self._recorded: dict[int, list] = {}  # microbatch -> its model calls' outputs (last stage)
        self._paused: dict[int, SuspendedStep] = {}  # microbatch -> its step, paused at the model call
        self._step_threads = StepThreads()  # reused: a fresh thread per microbatch runs the forward slower
        self._components = list(components)
        self._hooks = {h: [c for c in components if overrides(c, h)] for h in _STEP_HOOKS}
        self._metric_paths: Optional[dict[int, str]] = None  # id(metric) -> attribute path
        self._capture: Optional[Any] = None  # this step's log capture (pipelined steps only)
        self._ragged_sizes_told: set = set()  # batch sizes (or opaque batch types) run with fewer microbatches, warned once
        self._token_means = token_means  # the batch's token means over microbatches (pipelined steps)
        self._summed_losses = SummedLosses()  # sum-reduced losses over microbatches, warned about
        self._user_checkpoints = UserCheckpoints()  # torch's checkpoint of a stage's boundary block: run plainly

    @classmethod
    def build(cls, ctx: SetupContext, components: Sequence[Component]) -> "StepRunner":
        """The runner for this rank: one local stage, or ``ctx.stage`` of a pipeline."""
        if ctx.stage is None:
            return cls(executor=PipelineExecutor(LocalCommunicator(), pp_size=1, pp_rank=0), components=components)
        from megastrategy.pipeline.p2p import PipelineCommunicator

        ps, config = ctx.parallel_state, ctx.config
        comm = PipelineCommunicator(
            pp_group=ps.pp_group, pp_ranks=ps.pp_ranks, pp_rank=ps.pp_rank, device=ctx.device,
            tp_group=ps.tp_group, scatter_gather=not config.sequence_parallel,  # SP: TP ranks hold different slices
        )
        placement = schedule_placement(config.pipeline_schedule, config.pp, config.vp_size)
        executor = PipelineExecutor(comm, pp_size=config.pp, pp_rank=ps.pp_rank, vp_size=config.vp_size,
                                    placement=placement)
        # the rank of the last stage (the last rank; rank 0 under ZB-V's V) relays the step's outputs
        relay = OutputRelay(group=ps.pp_group, src=ps.pp_ranks[placement.last_rank], device=ctx.device,
                            tp_group=ps.tp_group)
        return cls(
            executor=executor, components=components, stage=ctx.stage,
            num_microbatches=config.num_microbatches, relay=relay, device=ctx.device,
            schedule=config.pipeline_schedule,
            # under cp the context-parallel loss already takes the mean over every rank's tokens
            token_means=TokenMeans() if config.cp == 1 else None,
        )

    @property
    def pipelined(self) -> bool:
        return self.stage is not None

    # ------------------------------------------------------------------ one step
    def run(
        self,
        module: Any,
        step_name: str,
        args: tuple,
        kwargs: Mapping[str, Any],
        *,
        accumulate_grad_batches: int = 1,
        grad_scale: float = 1.0,
        lightning_backward: Optional[LightningBackward] = None,
        backward_hooks: Optional[BackwardHooks] = None,
    ) -> Any:
        """One whole step; returns what this rank hands back to Lightning.

        ``lightning_backward(loss)`` runs the single stage's backward the way Lightning would
        (hooks, precision plugin); ``None`` (manual optimization) leaves backward to the user.
        ``backward_hooks(loss)`` runs Lightning's backward hooks without a backward: under
        pipelining, once after the schedule, with the step's loss as Lightning scales it.
        """
        microbatches = self._split(step_name, args, kwargs)
        step = StepInfo(step_name, len(microbatches), accumulate_grad_batches, grad_scale)
        for c in self._hooks["begin_step"]:
            c.begin_step(module, step)
        outputs: list = []
        user_step = self._user_step(getattr(module, step_name), microbatches, args[1:], kwargs, step)
        if self.pipelined:
            with self._step_watches(module, step, microbatches):
                # microbatches are equal parts of the batch: one size for all
                sizes = [_leading_size(microbatches[0])] * len(microbatches)
                result = self._run_pipelined(module, step, user_step, outputs, sizes)
            loss = _user_loss(result) if step.training else None
            if backward_hooks is not None and loss is not None:
                backward_hooks(loss / step.accumulate_grad_batches if step.accumulate_grad_batches > 1 else loss)
        else:
            forward_step = _single_stage_forward(user_step, outputs, step)
            self._execute(step, forward_step, _single_stage_backward(outputs, lightning_backward))
            result = outputs[0]
        for c in self._hooks["end_step"]:
            c.end_step(module, step)
        return result

    @contextmanager
    def _step_watches(self, module: Any, step: StepInfo, microbatches: list) -> Iterator[None]:
        """While a pipelined step runs: the user's checkpoints of boundary blocks run plainly, and with
        several microbatches token means are made the batch's and sum-reduced losses warned about."""
        with ExitStack() as stack:
            stack.enter_context(self._user_checkpoints.step(step.name, module))
            if len(microbatches) > 1:
                stack.enter_context(self._running_buffers.step(module, step))
                stack.enter_context(self._summed_losses.step(step.name, len(microbatches)))
                if self._token_means is not None:
                    stack.enter_context(self._token_means.step(step.name, microbatches))
            yield
            return
        with ExitStack() as stack:
            stack.enter_context(self._summed_losses.step(step.name, len(microbatches)))
            if self._token_means is not None:
                stack.enter_context(self._token_means.step(step.name, microbatches))
            yield

    def _split(self, step_name: str, args: tuple, kwargs: Mapping[str, Any]) -> list:
        batch = args[0]
        if not self.pipelined:
            return [batch]  # the user's batch exactly as Lightning gave it
        if kwargs:
            raise MegatronConfigError(
                f"{step_name} received keyword arguments {sorted(kwargs)}; pipelining passes (batch, batch_idx)."
            )
        sizes = _tensor_sizes(batch)
        if not sizes:
            self._tell_opaque(batch)
            return [batch]  # one microbatch: one device's result, without the pipeline's overlap
        size = sizes[0]
        m = self._training_microbatches(size) if step_name == "training_step" else _eval_microbatches(size, self.num_microbatches)
        return list(iter_microbatches(batch, m))

    def _tell_opaque(self, batch: Any) -> None:
        """Said once per batch type: a batch whose tensors the splitter cannot see runs whole."""
        if self.num_microbatches > 1 and type(batch) not in self._ragged_sizes_told:
            self._ragged_sizes_told.add(type(batch))
            log_on_rank_zero(_log, logging.WARNING, (
                f"megastrategy: the batch ({type(batch).__name__}) holds no tensor that can be split along dim 0 "
                f"(tensors are found in dicts, lists, tuples, mappings and dataclasses), so it runs as one microbatch "
                f"instead of num_microbatches={self.num_microbatches}: the same losses, a longer pipeline bubble. "
                f"Return a dict or a dataclass of tensors from collate_fn / transfer_batch_to_device to pipeline it."))

    def _training_microbatches(self, size: int) -> int:
        """``num_microbatches``, or fewer for a batch it does not divide (said once per size)."""
        ex, wanted = self.executor, self.num_microbatches
        m = microbatches_for(size, wanted, self.schedule, ex.pp_size, ex.pp_rank, ex.vp_size)
        if m != wanted and size not in self._ragged_sizes_told:
            self._ragged_sizes_told.add(size)
            log_on_rank_zero(_log, logging.WARNING, (
                f"megastrategy: a training batch of {size} examples runs as {m} microbatches: "
                f"num_microbatches={wanted} does not divide it (same losses and gradients, a longer pipeline bubble). "
                f"An epoch's ragged last batch does this; for every batch, pick a batch size that is a multiple of {wanted}."))
        return m

    def _run_pipelined(self, module: Any, step: StepInfo, user_step: Callable, outputs: list, sizes: list) -> Any:
        if self._metric_paths is None:  # the module's structure is fixed once it is sharded
            self._metric_paths = metric_paths(module)
        with capturing_logs(module, self._metric_paths) as capture:
            self._capture = capture
            try:
                self._execute(step, self._stage_forward(user_step, outputs, step), None)
                self._finish_steps(module, step, outputs)
            finally:
                for paused in self._paused.values():
                    paused.abort()
                self._capture, self._recorded, self._paused = None, {}, {}
        replay_logs(module, capture)
        return join_step_outputs(outputs, step.name, sizes)

    def _finish_steps(self, module: Any, step: StepInfo, outputs: list) -> None:
        """Relay the last stage's model outputs; the other stages finish each microbatch's paused step."""
        holds_last = self.executor.holds_last_stage
        relayed = self.relay.relay([self._recorded[m] for m in range(step.num_microbatches)] if holds_last else None)
        if holds_last:
            return
        for microbatch, calls in enumerate(relayed):
            outputs.append(self._paused.pop(microbatch).resume(calls))
            if step.training:
                refuse_local_loss_terms(_user_loss(outputs[-1]), module, step.name, self.executor.pp_rank,
                                        self.executor.pp_size)

    def _execute(self, step: StepInfo, forward_step: Callable, backward_fn: Optional[LightningBackward]) -> None:
        m, ex = step.num_microbatches, self.executor
        if step.training:
            steps = training_steps(self.schedule, m, ex.pp_size, ex.pp_rank, ex.vp_size)
        else:
            steps = forward_only_steps(m, ex.vp_size)
        scale = 1.0 / step.accumulate_grad_batches
        if self.pipelined:  # the schedule runs backward itself, so it applies the loss scale
            scale *= step.grad_scale
        with torch.set_grad_enabled(step.training):
            ex.run(
                steps, forward_step=forward_step, num_microbatches=m, forward_only=not step.training,
                loss_scale=scale / m, backward_fn=backward_fn,
                on_forward=self._callback("on_forward") if step.training else None,
                on_backward=self._callback("on_backward") if step.training else None,
            )

    def _callback(self, hook: str) -> Optional[Callable[[int, int], None]]:
        targets = [getattr(c, hook) for c in self._hooks[hook]]
        if not targets:
            return None

        def call(chunk: int, microbatch: int) -> None:
            for fn in targets:
                fn(chunk, microbatch)

        return call

    # ------------------------------------------------------------------ one microbatch
    def _user_step(
        self, step_fn: Callable, microbatches: list, rest: tuple, kwargs: Mapping[str, Any], step: StepInfo
    ) -> Callable:
        """``run_user_step(microbatch, keep_logs, pause)``: the user's step on one microbatch, in the
        components' per-microbatch context; ``keep_logs=False`` drops its ``self.log`` calls (the
        run of an earlier chunk, which ends at a stage cut; the chunk that finishes the step repeats them). With
        ``pause`` the step pauses at its model call (:meth:`_start_paused`), leaving the components'
        contexts while it waits, since other microbatches enter them meanwhile."""
        contexts, preparers = self._hooks["forward_context"], self._hooks["prepare_microbatch"]

        def run_user_step(microbatch: int, keep_logs: bool = True, pause: Optional[Callable] = None) -> Any:
            batch = microbatches[microbatch]
            if self._capture is not None:
                self._capture.begin_microbatch(batch, keep=keep_logs)
            for c in preparers:
                batch = c.prepare_microbatch(batch, step)
            tokens = self._token_means if self.pipelined and len(microbatches) > 1 else None
            with ExitStack() as stack:
                def enter() -> None:
                    for c in contexts:
                        stack.enter_context(c.forward_context(batch))
                    if tokens is not None:
                        stack.enter_context(tokens.microbatch(microbatch))

                enter()
                if pause is None:
                    return step_fn(batch, *rest, **kwargs)

                def leave_and_pause(activation: torch.Tensor) -> list:
                    stack.close()
                    relayed = pause(activation)
                    enter()
                    return relayed

                with self.calls.pausing(leave_and_pause, step.name):
                    return step_fn(batch, *rest, **kwargs)

        return run_user_step

    def _stage_forward(self, run_user_step: Callable, outputs: list, step: StepInfo) -> Callable:
        stage = self.stage

        def forward_step(chunk: int, microbatch: int, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
            stage.activate(chunk, input_tensor)
            probing = stage.probing  # deactivate() ends the probe; the output is checked after it
            whole = stage.is_last_virtual(chunk)  # this run reaches the end of the user's step
            try:
                if not whole and chunk == stage.vp_size - 1:  # the step goes on here after the relay
                    return self._start_paused(run_user_step, microbatch, step)
                with self.calls.recording() if whole else nullcontext() as recorded:
                    out = run_user_step(microbatch, keep_logs=whole)
            except StageBoundary as boundary:
                return boundary.output
            finally:
                stage.deactivate()
            if not whole:
                raise MegatronConfigError(
                    f"{step.name} finished on pipeline stage {stage.pp_rank} chunk {chunk} without running its last "
                    f"block: the forward must run the blocks of {stage.stack_path} in order."
                )
            stage.refuse_marked_output((out, recorded), probing)
            self._recorded[microbatch] = recorded
            outputs.append(out)
            return _as_loss(out, step.name) if step.training else _NOTHING()

        return forward_step

    def _start_paused(self, run_user_step: Callable, microbatch: int, step: StepInfo) -> torch.Tensor:
        """Run the microbatch's step up to the stage cut in its own thread, paused there until the relay."""

        def body(paused: SuspendedStep) -> Any:
            return run_user_step(microbatch, keep_logs=True, pause=paused.pause)

        paused = SuspendedStep(body, self._step_threads)
        kind, value = paused.start()
        if kind != "paused":
            raise MegatronConfigError(
                f"{step.name} finished on pipeline stage {self.stage.pp_rank} without running its last block: the "
                f"forward must run the blocks of {self.stage.stack_path} in order."
            )
        self._paused[microbatch] = paused
        return value


_STEP_HOOKS = ("begin_step", "prepare_microbatch", "forward_context", "on_forward", "on_backward", "end_step")


def _NOTHING() -> torch.Tensor:
    """What the executor keeps of a microbatch with nothing to backpropagate (the real outputs
    are collected separately)."""
    return torch.zeros(())


def _single_stage_forward(run_user_step: Callable, outputs: list, step: StepInfo) -> Callable:
    def forward_step(chunk: int, microbatch: int, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        out = run_user_step(microbatch)
        outputs.append(out)
        loss = _user_loss(out) if step.training else None
        return loss if loss is not None and loss.numel() == 1 else _NOTHING()

    return forward_step


def _single_stage_backward(outputs: list, lightning_backward: Optional[LightningBackward]) -> Optional[LightningBackward]:
    """Backward of the one stage's loss through Lightning, unless there is nothing to run it on
    (manual optimization, or a ``training_step`` that returned ``None`` to skip the batch)."""
    if lightning_backward is None:
        return lambda loss: None

    def backward(loss: torch.Tensor) -> None:
        if outputs and _user_loss(outputs[0]) is not None:
            lightning_backward(loss)

    return backward


def _user_loss(output: Any) -> Optional[torch.Tensor]:
    """The loss Lightning would backpropagate from a ``training_step`` output, if any."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


def _as_loss(output: Any, step_name: str) -> Optional[torch.Tensor]:
    """The loss of a last-stage microbatch under pipelining (every microbatch needs one)."""
    if output is None:
        return None
    loss = _user_loss(output)
    if loss is None:
        raise MegatronConfigError(
            f"{step_name} returned {type(output).__name__}; under pipeline parallelism it must return the loss "
            "tensor, a dict with a 'loss' key, or None."
        )
    return loss


def _eval_microbatches(size: int, wanted: int) -> int:
    """Evaluation batches may be ragged (the last one); use the largest divisor up to ``wanted``."""
    return max(d for d in range(1, min(wanted, size) + 1) if size % d == 0)


def _tensor_sizes(batch: Any) -> list[int]:
    return [x.shape[0] for x in flatten_batch(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0]


def _leading_size(batch: Any) -> int:
    """The batch size: dim 0 of the batch's first tensor with a dim (1 when there is none)."""
    sizes = _tensor_sizes(batch)
    return sizes[0] if sizes else 1
