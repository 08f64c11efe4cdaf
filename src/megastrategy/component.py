"""The protocol every feature of the strategy implements, and what it is handed.

A component is one capability (tensor parallelism, the pipeline, MoE, gradient buffers, ...).
``MegatronStrategy`` keeps a literal, ordered list of them and calls the hooks below in that
order (``teardown`` in reverse). Every hook is optional: the base class does nothing, so a
component overrides only the moments it cares about. Adding a parallelism means writing one
component and adding one line to the strategy's list.

Moments, in the order Lightning reaches them:

* before any process group: ``check_device`` then ``validate`` (the model, when it already has
  parameters);
* groups exist: ``on_environment``;
* ``setup``: ``configure`` (every component), ``apply`` (rewrite the model, in list order), then, when fitting, ``on_fit_setup``
  (after the model is on its device) and ``wrap_optimizers``; after a restore into the set-up model: ``on_weights_loaded``;
* ``on_train_loader``, ``on_train_start``; each batch: ``on_batch``; each step: ``begin_step``, then per microbatch ``prepare_microbatch``, ``forward_context``,
  ``on_forward``, ``on_backward``, then ``end_step``;
* each optimizer step: ``last_microbatch_context`` around the closure, ``finalize_grads`` after
  it (returning ``False`` skips the step on every rank), ``zero_grads`` after the step;
* ``on_exception``, ``teardown``.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Optional

import torch
from torch import nn

from megastrategy.config import MegatronConfig

if TYPE_CHECKING:
    from megastrategy.anatomy import ModelAnatomy
    from megastrategy.ddp.grad_buffer import GradientBuffer
    from megastrategy.layers.plan import ResolvedPlan
    from megastrategy.layers.random import ModelParallelRNGTracker
    from megastrategy.parallel_state import ParallelLayout, ParallelState
    from megastrategy.pipeline.stage import PipelineStage

__all__ = ["Component", "SetupContext", "StepInfo", "Environment"]


@dataclass
class Environment:
    """What exists once the process groups do."""

    config: MegatronConfig
    layout: "ParallelLayout"
    parallel_state: "ParallelState"
    global_rank: int
    world_size: int
    device: torch.device


@dataclass
class SetupContext:
    """Shared, typed facts about the model being set up; components read what earlier ones wrote.

    The strategy fills the first block; the rest is written by the component named beside it.
    """

    config: MegatronConfig
    parallel_state: "ParallelState"
    device: torch.device
    module: nn.Module
    rng_tracker: "ModelParallelRNGTracker"
    anatomy: Optional["ModelAnatomy"]
    backend_in_use: str = "torch"
    plan: Optional["ResolvedPlan"] = None  # TensorParallel
    stage: Optional["PipelineStage"] = None  # Pipeline
    num_moe_layers: int = 0  # ExpertParallel
    grad_buffers: list["GradientBuffer"] = field(default_factory=list)  # GradientBuffers, ExpertParallel
    # parameters whose main_grad a component changes between backward and the DP reduction (a
    # pipeline's tied/shared weights, sequence-parallel norms): never reduced early (on_fit_setup)
    grads_changed_after_backward: list[nn.Parameter] = field(default_factory=list)  # Pipeline, SequenceParallel
    overlap_grad_reduce: bool = False  # the strategy, per fit (ddp/overlap_policy.py resolves None)
    precision_plugin: Any = None

    @classmethod
    def create(cls, config: MegatronConfig, parallel_state: "ParallelState", device: torch.device,
               module: nn.Module) -> "SetupContext":
        """A fresh context: the anatomy found once, the TP-aware random streams seeded."""
        from megastrategy.anatomy import ModelAnatomy
        from megastrategy.layers.random import ModelParallelRNGTracker

        tracker = ModelParallelRNGTracker(tp_rank=parallel_state.tp_rank, device=device)
        tracker.seed(torch.initial_seed())
        return cls(config, parallel_state, device, module, tracker, ModelAnatomy.find(module, config.pipeline_layers))

    @property
    def grad_reduce_group(self):
        """The group gradients are averaged over: data-parallel replicas and, under context
        parallelism, the cp ranks that each hold part of every sequence (dp×cp; dp when cp=1)."""
        return self.parallel_state.dp_cp_group

    @property
    def stack_path(self) -> Optional[str]:
        """The layer stack's path: the stage's once cut, else the anatomy's, else the user's argument."""
        if self.stage is not None:
            return self.stage.stack_path
        if self.anatomy is not None:
            return self.anatomy.stack_path
        return self.config.pipeline_layers


@dataclass(frozen=True)
class StepInfo:
    """One Lightning step as the components see it."""

    name: str  # "training_step", "validation_step", ...
    num_microbatches: int
    accumulate_grad_batches: int = 1
    grad_scale: float = 1.0  # the fp16 GradScaler's scale (1 without one)

    @property
    def training(self) -> bool:
        return self.name == "training_step"


class Component:
    """Base class: every hook is a no-op (see the module docstring for when each runs).

    ``enabled`` is ``False`` for a feature the configuration does not ask for; the strategy
    then leaves the component out of its list.
    """

    enabled: bool = True

    # ---------------------------------------------------------------- before groups
    def check_device(self, device: torch.device) -> None:
        """Refuse what this device cannot run (called once the device is known, before groups)."""

    def validate(self, module: nn.Module, layout: "ParallelLayout") -> None:
        """Refuse a model this component cannot serve, before any collective."""

    # ---------------------------------------------------------------- groups, setup
    def configure(self, ctx: SetupContext) -> None:
        """Before any component rewrites the model: record decisions others depend on."""

    def on_environment(self, env: Environment) -> None:
        """Process groups exist (start background services here)."""

    def apply(self, module: nn.Module, ctx: SetupContext) -> None:
        """Rewrite ``module`` in place; record what later components need in ``ctx``."""

    def on_fit_setup(self, module: nn.Module, ctx: SetupContext) -> None:
        """Fitting only, once the model is on its device: build gradient state."""

    def wrap_optimizers(self, optimizers: list) -> list:
        return optimizers

    def on_weights_loaded(self) -> None:
        """The strategy wrote the parameters after ``setup``: a checkpoint restore (``fit(ckpt_path=...)``
        of a split module, ``LearningRateFinder`` putting the weights back)."""

    # ---------------------------------------------------------------- data and steps
    def on_train_loader(self, loader: Any, trainer: Any) -> Any:
        """The training loader Lightning will iterate (fitting only)."""
        return loader

    def on_train_start(self) -> None:
        """Training is about to run its first (or, after a restart, next) step."""

    def on_batch(self, batch: Any, device: torch.device) -> Any:
        return batch

    def on_activity(self, text: str) -> None:
        """What this rank is doing now (for failure reports)."""

    def begin_step(self, module: nn.Module, step: StepInfo) -> None:
        pass

    def prepare_microbatch(self, microbatch: Any, step: StepInfo) -> Any:
        """Each microbatch before the user's step sees it (e.g. split along the sequence)."""
        return microbatch

    def forward_context(self, microbatch: Any) -> ContextManager:
        """Entered around the user's step for one (prepared) microbatch: forward and loss."""
        return nullcontext()

    def on_forward(self, chunk: int, microbatch: int) -> None:
        pass

    def on_backward(self, chunk: int, microbatch: int) -> None:
        """After the microbatch's backward is complete: its whole backward, or under a zero-bubble
        schedule its deferred weight-gradient step (W), when nothing of its forward is needed any more."""

    def end_step(self, module: nn.Module, step: StepInfo) -> None:
        pass

    # ---------------------------------------------------------------- optimizer step
    def last_microbatch_context(self, backward_passes: int) -> ContextManager:
        """Entered around the closure that runs the step's last backward."""
        return nullcontext()

    def finalize_grads(self) -> bool:
        """After the last backward, before the optimizer; ``False`` skips the step everywhere."""
        return True

    def zero_grads(self) -> None:
        """After the optimizer step (or a skipped one)."""

    # ---------------------------------------------------------------- end
    def on_exception(self, exception: BaseException) -> None:
        pass

    def teardown(self) -> None:
        pass


def overrides(component: Component, hook: str) -> bool:
    """Whether ``component`` implements ``hook`` (lets hot paths skip no-op calls)."""
    return getattr(type(component), hook) is not getattr(Component, hook)
