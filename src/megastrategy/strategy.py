"""``MegatronStrategy``: Megatron-LM parallelism as a Lightning strategy for unchanged modules.

This class is Lightning's lifecycle and nothing else. The work lives in components
(:mod:`megastrategy.component`), listed in order in :meth:`MegatronStrategy.build_components`;
every step of every layout runs through one :class:`~megastrategy.pipeline.step_runner.StepRunner`.

Lifecycle (Lightning calls these in this order): ``__init__`` (the typed configuration is
validated) → ``_configure_launcher`` (the layout, before any process starts) →
``setup_environment`` (device checks, model checks, then the groups) → ``setup`` (components
rewrite the model; gradient buffers and optimizers) → steps → ``teardown``.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack, nullcontext
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Optional, TypeVar

import torch
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from megastrategy import all_components as parts
from megastrategy.callback_adapters import adapt_callbacks
from megastrategy.callback_guard import refuse_callbacks
from megastrategy.checkpoint.save_pretrained_guard import sharding_of
from megastrategy.checkpoint.strategy_methods import CheckpointMethods
from megastrategy.component import Component, Environment, SetupContext
from megastrategy.component_list import ComponentList
from megastrategy.config import MegatronConfig, split_strategy_arguments
from megastrategy.ddp.overlap_policy import resolve_overlap_grad_reduce
from megastrategy.ddp.user_clip import UserNormClipping, parameter_ids
from megastrategy.parallel_state import ParallelLayout, ParallelState
from megastrategy.pipeline.frozen_stage import empty_optimizers_allowed
from megastrategy.pipeline.step_runner import StepRunner
from megastrategy.outside_run_guard import guard_outside_runs
from megastrategy.rank_zero import log_on_rank_zero
from megastrategy.lightning_steps import LightningStepMethods
from megastrategy.precision import adopt_precision_plugin
from megastrategy.replica_collectives import ReplicaCollectives
from megastrategy.replicas import broadcast_module_states, set_metric_process_group
from megastrategy.second_fit import adopt_earlier_split
from megastrategy.split_record import attach_record, record_of
from megastrategy.signature import passthrough_arguments, signature_from
from megastrategy.unstepped_grads import clear_unstepped_grads

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)
C = TypeVar("C", bound=Component)
_LIGHTNING_ARGUMENTS = set(passthrough_arguments(DDPStrategy.__init__, MegatronConfig))


class MegatronStrategy(LightningStepMethods, CheckpointMethods, ReplicaCollectives, DDPStrategy):
    """Tensor, pipeline, data and expert parallelism for an existing ``LightningModule``.

    Takes every field of :class:`~megastrategy.config.MegatronConfig` as a keyword (``tp``,
    ``pp``, ``vp``, ``ep``, ``tp_plan``, ``sequence_parallel``, ...; documented there); any other
    keyword goes to Lightning's ``DDPStrategy``. ``inspect.signature`` (and ``LightningCLI``) sees
    all of them, typed (:mod:`megastrategy.signature`).
    """

    strategy_name = "megatron"

    @signature_from(MegatronConfig, DDPStrategy.__init__)
    def __init__(self, tp: int = 1, pp: int = 1, **kwargs: Any) -> None:
        ours, lightning = split_strategy_arguments(kwargs, _LIGHTNING_ARGUMENTS)
        self.config = MegatronConfig(tp=tp, pp=pp, **ours)
        super().__init__(timeout=self.config.timeout, **lightning)
        self.layout: Optional[ParallelLayout] = None
        self.parallel_state: Optional[ParallelState] = None
        self.grad_buffers, self.checkpoints = parts.GradientBuffers(self.config), parts.Checkpoints(self.config)
        self.components = ComponentList(self.build_components(self.config))
        self._ctx: Optional[SetupContext] = None
        self._runner: Optional[StepRunner] = None
        self._model_validated = False
        self._grads_finalized = False  # reduced for this optimizer step (manual clipping may come first)
        self._user_clipping = UserNormClipping(lambda: parameter_ids(self.lightning_module), self._clip_user_params)

    def build_components(self, c: MegatronConfig) -> list[Component]:
        """Every feature, in the order its hooks run (teardown in reverse); disabled ones drop out."""
        return [
            parts.Watchdog(c),
            parts.NonFiniteGuard(c),
            parts.BatchBroadcast(c),
            parts.TensorParallel(c),
            parts.ShardLossTerms(c),  # tp, pp=1: the first step's loss read for shards outside their layers
            parts.SequenceParallel(c),
            parts.TransformerEngine(c),
            parts.Recompute(c),
            parts.ContextParallelComponent(c),
            parts.Pipeline(c),
            parts.ExpertParallel(c),
            parts.CudaGraphs(c),
            parts.AveragedCopies(c),  # after every component that splits the model, before the grad buffer
            parts.SyncBatchNormLayers(c, lambda: self._layer_sync is not None),  # Trainer(sync_batchnorm=True)
            parts.BufferBroadcast(c, self._ddp_kwargs.get("broadcast_buffers", True)),
            self.grad_buffers,
            self.checkpoints,
            parts.WeightsWrittenAfterSplit(c),  # after the optimizers are wrapped: fingerprints the set-up weights
        ]

    def component(self, kind: type[C]) -> Optional[C]:
        """The component of type ``kind`` in use, if any."""
        return self.components.find(kind)

    # ------------------------------------------------------------------ layout, groups
    def _make_layout(self) -> ParallelLayout:
        return self.config.layout(self.num_nodes * self.num_processes)

    def _configure_launcher(self) -> None:
        # The earliest point where the world size is known, in the launching process:
        # a bad layout fails here, before any process is started or group created.
        self.layout = self._make_layout()
        super()._configure_launcher()

    def setup_distributed(self) -> None:
        """Lightning's, except that a gloo default group on a CUDA device is not bound to it.

        torch (2.11 seen) builds the parallel groups of a device-bound default group by splitting
        it, which its gloo backend cannot do. gloo on CUDA is what several ranks sharing one GPU
        use (NCCL refuses them), so the device stays unbound there; NCCL keeps Lightning's binding.
        """
        if self.root_device.type != "cuda" or "gloo" not in str(self._get_process_group_backend()):
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    def setup_environment(self) -> None:
        adopt_earlier_split(self, self.lightning_module)  # a new Trainer's fit of a module split before
        self.layout = self._make_layout()
        self.components.each("check_device", self.root_device)
        self._validate_model()  # model errors also come before the first collective
        super().setup_environment()  # default process group
        if self.parallel_state is None or self.parallel_state.layout != self.layout:
            self.parallel_state = ParallelState(
                self.layout, self.global_rank, backend=self._process_group_backend, timeout=self._timeout
            )
        log_on_rank_zero(log, logging.INFO, self.layout.summary())
        log.debug(self.parallel_state.describe())  # this rank's coordinates
        env = Environment(self.config, self.layout, self.parallel_state, self.global_rank, self.world_size,
                          self.root_device)
        self.components.each("on_environment", env)

    def _validate_model(self) -> None:
        module = self.lightning_module
        if self._model_validated or module is None or getattr(module, "_megastrategy_sharded", False):
            return
        if not any(True for _ in module.parameters()):
            return  # built in configure_model(); validated in setup()
        self.components.each("validate", module, self.layout)
        self._model_validated = True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        ps = self._state()
        return {"num_replicas": ps.dp_size, "rank": ps.dp_rank}

    def _state(self) -> ParallelState:
        if self.parallel_state is None:
            raise RuntimeError("MegatronStrategy: process groups are not set up yet (setup_environment has not run).")
        return self.parallel_state

    # ------------------------------------------------------------------ model
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module, ps = self.lightning_module, self._state()
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_callbacks(trainer.callbacks, self.config.tp, self.config.pp)
        sharded = getattr(module, "_megastrategy_sharded", False)
        if not sharded:
            broadcast_module_states(module, src=0)  # every rank starts from rank 0's weights
            self._validate_model()
        if self._ctx is None or not sharded:
            self._ctx = SetupContext.create(self.config, ps, self.root_device, module)
        self._ctx.precision_plugin = self.precision_plugin
        self.components.each("configure", self._ctx)
        if not sharded:
            self.components.each("apply", module, self._ctx)
            module._megastrategy_sharded = True
            set_metric_process_group(module, ps.dp_group)
            guard_outside_runs(module, attach_record(module, self), sharding_of(ps))
        if self._runner is None or not sharded:
            self._runner = StepRunner.build(self._ctx, self.components)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_gradients(trainer, module)
        adapt_callbacks(trainer.callbacks, self._ctx, fitting=trainer.state.fn == TrainerFn.FITTING)
        self.setup_precision_plugin()
        adopt_precision_plugin(self.precision_plugin, clip_norm=self.grad_buffers.clip_grad_norm,
                               clip_value=self.grad_buffers.clip_grad_value, grads_visible=self.grad_buffers.grads_visible,
                               finalize=self._finalize_grads)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_gradients(self, trainer: "pl.Trainer", module: nn.Module) -> None:
        self._ctx.grad_buffers.clear()
        self._ctx.grads_changed_after_backward.clear()
        overlap, why = resolve_overlap_grad_reduce(self.config.overlap_grad_reduce, module, trainer)
        self._ctx.overlap_grad_reduce = overlap
        log.debug("megastrategy: overlap_grad_reduce=%s (%s)", overlap, why)
        self.components.each("on_fit_setup", module, self._ctx)
        with empty_optimizers_allowed(module, self._ctx.stage):
            self.setup_optimizers(trainer)
        self.optimizers = self.components.chain("wrap_optimizers", self.optimizers)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self.components.each("on_weights_loaded")  # the strategy's own write, not the user's

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: the gradient buffer does data parallelism."""

    # ------------------------------------------------------------------ gradients
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The true global gradient norm (the one clipping uses), e.g. in ``on_before_optimizer_step``.
        Collective: call it on every rank. Lightning's ``grad_norm(module)`` sees only this rank's shards."""
        return self.grad_buffers.grad_norm(self.optimizers, norm_type)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.training:
            dataloader = self.components.chain("on_train_loader", dataloader, trainer)
        return dataloader

    def on_train_start(self) -> None:
        super().on_train_start()
        self.components.each("on_train_start")
        if self.config.tp * self.config.pp > 1 or self.config.use_distributed_optimizer:  # else p.grad is DDP's
            self._user_clipping.install()  # a local norm would be wrong (split model) or see no p.grad (ZeRO-1)

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # The first per-batch call Lightning makes: the right moment to say what this rank is doing.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            what = "training" if trainer.training else str(trainer.state.stage or "running")
            self._doing(f"{what} step {trainer.global_step}")
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.parallel_state is not None:
            batch = self.components.chain("on_batch", batch, device or self.root_device)
        return batch

    def _doing(self, text: str) -> None:  # what this rank is doing, for failure reports
        self.components.each("on_activity", text)

    # ------------------------------------------------------------------ optimization
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        calls = [0]

        def closure_then_finalize() -> Any:
            calls[0] += 1
            if calls[0] > 1:  # an optimizer that re-evaluates (LBFGS): the new backward's gradients are reduced again
                self._grads_finalized = False
            with ExitStack() as stack:
                self.components.last_microbatch(stack, self._runner.num_microbatches)
                result = closure()
            self._doing(f"gradient reduction and optimizer step {self.lightning_module.trainer.global_step}")
            self._finalize_grads()
            return result

        try:
            return super().optimizer_step(optimizer, closure_then_finalize, model, **kwargs)
        finally:
            self.components.each("zero_grads")
            self._grads_finalized = False

    def _before_training_step(self) -> None:
        """One device's zero_grad before backward, for gradients a closure left without a step."""
        if self._ctx is not None:
            clear_unstepped_grads(self.lightning_module.trainer, self._ctx.grad_buffers,
                                  lambda: self.components.each("zero_grads"))

    def _before_backward(self, loss: torch.Tensor) -> None:
        shard_terms = self.component(parts.ShardLossTerms)
        if shard_terms is not None:
            shard_terms.check(loss)  # tp: a loss value that counts this rank's shards is refused

    def _clip_user_params(self, params: list, max_norm: float, norm_type: float) -> torch.Tensor:
        """The user's ``torch.nn.utils.clip_grad_norm_`` on the model: reduced first under manual
        optimization (called before ``opt.step()``), as ``self.clip_gradients`` does."""
        if not self.lightning_module.automatic_optimization:
            self._finalize_grads()
        return self.grad_buffers.clip_params_grad_norm(params, max_norm, norm_type)

    def _finalize_grads(self) -> None:
        """Once per optimizer step: from the step's closure, or earlier from a manual ``clip_gradients``."""
        if not self._grads_finalized and any(b.has_grads for b in self._ctx.grad_buffers):
            self.components.finalize_grads()  # every rank skips together when one component says so
        self._grads_finalized = True

    # ------------------------------------------------------------------ parameter reads
    def wait_for_param_gather(self) -> None:
        """With ``overlap_param_gather``: finish the background all-gathers of the last optimizer
        step, so every parameter holds its update. Forward pre-hooks do this per bucket during
        training; the strategy calls it before checkpoints, evaluation and the end of training.
        Call it yourself before reading parameters outside a forward (e.g. in ``on_train_batch_end``)."""
        self.grad_buffers.wait_for_params()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_for_param_gather()
        with self.module_in_use():  # trainer.save_checkpoint after fit
            return super().lightning_module_state_dict()

    def module_in_use(self) -> ContextManager[None]:
        """A span in which the split module is used on every rank outside a Trainer run (a save or
        export after fit): its forward and ``state_dict`` are refused elsewhere (outside_run_guard.py)."""
        record = record_of(self.lightning_module)
        return record.use() if record is not None else nullcontext()

    def on_validation_start(self) -> None:
        self.wait_for_param_gather()
        super().on_validation_start()

    def on_train_end(self) -> None:  # test/predict after fit start from gathered parameters
        self._user_clipping.remove()
        self.wait_for_param_gather()
        super().on_train_end()

    # ------------------------------------------------------------------ end
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.components.each("on_exception", exception)

    def teardown(self) -> None:
        self._user_clipping.remove()
        self.components.teardown()
        super().teardown()
