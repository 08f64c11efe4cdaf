"""One typed, frozen configuration for ``MegatronStrategy``, validated once before any group exists.

Every argument rule lives here (rules that need the world size live in
:class:`~megastrategy.parallel_state.ParallelLayout`, rules that need the model in the components'
``validate``). :data:`CONSTRUCTOR_RULES` lists them in machine-readable form; a test checks that
the README's error table has a row for each, so the table cannot drift from the code.

Components receive this object (or the few values they need), never the strategy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from megastrategy.context.validation import LAYOUT_CHOICES, OUTPUT_CHOICES
from megastrategy.cuda_graphs.scope import validate_cuda_graph_scope
from megastrategy.ddp.grad_buffer import DEFAULT_BUCKET_NUMEL
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.fp8 import validate_fp8
from megastrategy.layers.recompute import validate_recompute_mode
from megastrategy.layers.sequence_parallel import validate_sequence_parallel
from megastrategy.layers.te_backend import BACKENDS
from megastrategy.parallel_state import DEFAULT_ORDER, ParallelLayout
from megastrategy.pipeline.schedule_choice import schedule_vp_size, validate_pipeline_schedule
from megastrategy.pipeline.zero_bubble_v import check_zb_v

__all__ = ["MegatronConfig", "CONSTRUCTOR_RULES", "Rule", "split_strategy_arguments"]


class Rule(NamedTuple):
    """One constructor rule: the argument it concerns, a value that breaks it, and the README
    error-table row that documents it."""

    argument: str
    bad_example: dict
    readme_situation: str


_BAD_VALUES = "bad argument values (`tp=0`, `tp_plan` not a dict, ...)"
_ZB_ROW = "unknown `pipeline_schedule`, or `\"zb_h1\"` without `pp > 1`, with `vp` or with `cuda_graph_scope`"
_ZBV_ROW = "`\"zb_v\"` without `pp > 1`, with `vp` other than 2, `num_microbatches < 2·pp - 1` or `cuda_graph_scope`"
_STAGE_LAYERS_ROW = "`pipeline_stage_layers` not `pp·vp` positive ints, or with `pp=1`"
CONSTRUCTOR_RULES: tuple[Rule, ...] = (
    Rule("tp", {"tp": 0}, _BAD_VALUES),
    Rule("pp", {"pp": -1}, _BAD_VALUES),
    Rule("cp", {"cp": 1.5}, _BAD_VALUES),
    Rule("ep", {"ep": 0}, _BAD_VALUES),
    Rule("num_microbatches", {"num_microbatches": 0}, _BAD_VALUES),
    Rule("tp_plan", {"tp_plan": ["blocks.*.qkv"]}, _BAD_VALUES),
    Rule("on_nonfinite", {"on_nonfinite": "ignore"}, _BAD_VALUES),
    Rule("async_checkpoint", {"async_checkpoint": "yes"}, _BAD_VALUES),
    Rule("activation_checkpointing", {"activation_checkpointing": "partial"}, _BAD_VALUES),
    Rule("overlap_grad_reduce", {"overlap_grad_reduce": "auto"}, _BAD_VALUES),
    Rule("overlap_param_gather", {"overlap_param_gather": True}, "`overlap_param_gather=True` without `use_distributed_optimizer=True`"),
    Rule("ep", {"ep": 2, "cp": 2}, "`ep > 1` with `cp > 1`"),
    Rule("cp_layout", {"cp": 2, "cp_layout": "zigzag"}, _BAD_VALUES),
    Rule("cp_output", {"cp": 2, "cp_output": "logits"}, _BAD_VALUES),
    Rule("sequence_parallel", {"sequence_parallel": True, "tp": 1},
         "`sequence_parallel=True` with `tp=1`, or a model it cannot split"),
    Rule("backend", {"backend": "cuda"}, "`backend` not `auto`/`torch`/`te`; `fp8=True` with `backend=\"torch\"`"),
    Rule("fp8", {"fp8": True, "backend": "torch"},
         "`backend` not `auto`/`torch`/`te`; `fp8=True` with `backend=\"torch\"`"),
    Rule("cuda_graph_scope", {"cuda_graph_scope": ["mlp"]},
         "unknown `cuda_graph_scope` name, `moe_preprocess` without `moe_router`, graphs with full recompute"),
    Rule("cuda_graph_scope", {"cuda_graph_scope": ["attn"], "activation_checkpointing": "full"},
         "unknown `cuda_graph_scope` name, `moe_preprocess` without `moe_router`, graphs with full recompute"),
    Rule("pipeline_stage_layers", {"pp": 2, "pipeline_stage_layers": (4,)}, _STAGE_LAYERS_ROW),
    Rule("pipeline_stage_layers", {"pp": 2, "pipeline_stage_layers": (3, 0)}, _STAGE_LAYERS_ROW),
    Rule("pipeline_stage_layers", {"pp": 1, "pipeline_stage_layers": (2,)}, _STAGE_LAYERS_ROW),
    Rule("pipeline_schedule", {"pp": 2, "pipeline_schedule": "gpipe"}, _ZB_ROW),
    Rule("pipeline_schedule", {"pp": 1, "pipeline_schedule": "zb_h1"}, _ZB_ROW),
    Rule("pipeline_schedule", {"pp": 2, "vp": 2, "pipeline_schedule": "zb_h1"}, _ZB_ROW),
    Rule("pipeline_schedule", {"pp": 2, "pipeline_schedule": "zb_h1", "cuda_graph_scope": ["attn"]}, _ZB_ROW),
    Rule("pipeline_schedule", {"pp": 1, "pipeline_schedule": "zb_v"}, _ZBV_ROW),
    Rule("pipeline_schedule", {"pp": 2, "vp": 4, "pipeline_schedule": "zb_v", "num_microbatches": 4}, _ZBV_ROW),
    Rule("num_microbatches", {"pp": 4, "pipeline_schedule": "zb_v"}, _ZBV_ROW),
    Rule("pipeline_schedule", {"pp": 2, "pipeline_schedule": "zb_v", "num_microbatches": 4, "cuda_graph_scope": ["attn"]},
         _ZBV_ROW),
)

@dataclass(frozen=True)
class MegatronConfig:
    """What the user asked for: every keyword ``MegatronStrategy`` takes.

    Args:
        tp: tensor-parallel size; every layer the plan names is split over ``tp`` ranks.
        pp, vp: pipeline stages, and virtual chunks per stage (interleaved schedule).
        pipeline_schedule: ``"1f1b"`` (interleaved when ``vp > 1``), ``"zb_h1"`` (zero bubble:
            each backward split into the input gradient and a deferred weight gradient; vp=None) or
            ``"zb_v"`` (zero bubble on two chunks per rank in a V, the loss on the first rank; vp=None
            or 2, ``num_microbatches >= 2*pp - 1``).
        cp: context-parallel size: every training sequence is split over ``cp`` ranks (evaluation
            runs unsplit). cp_layout: ``"balanced"`` (``2·cp`` chunks, equal causal work),
            ``"contiguous"`` or ``"auto"`` (contiguous for bidirectional models). cp_output:
            ``"tokens"`` (outputs stay split, token losses reduced over cp), ``"sequence"`` (the
            encoder output is gathered for heads that pool the sequence) or ``"auto"``.
        ep, etp: expert-parallel size and expert-TP size (default ``tp``).
        num_microbatches: microbatches per training step under ``pp > 1`` (default ``pp``).
        tp_plan: ``{glob over named_modules(): "column" | "row" | "vocab" | "replicate"}``;
            ``None`` detects Hugging Face and ``torch.nn.Transformer*Layer`` models.
        pipeline_layers: dotted path of the ``nn.ModuleList`` of blocks (default: found).
        pipeline_stage_layers: blocks per virtual pipeline stage, in stage order (``pp·vp``
            positive counts summing to the blocks); default: equal shares, the earliest stages
            taking the remainder (12 blocks on 5 stages: 3, 3, 2, 2, 2).
        order: how the rank grid is laid out, first dimension varying fastest.
        broadcast_batch: broadcast each batch from the first rank of its model replica (TP, CP and
            pipeline ranks) so random data pipelines cannot diverge; ``None`` = when tp·cp·pp > 1.
        grad_reduce_in_fp32, bucket_numel: gradient accumulation dtype and DP bucket size.
        timeout: the limit for every collective.
        watchdog, heartbeat_timeout: when a rank fails, stop every rank within seconds naming it.
        detect_anomalies, on_nonfinite: check gradients for NaN/inf on every rank before each
            optimizer step, then ``"skip"`` the step on every rank or ``"raise"`` on every rank.
        use_distributed_optimizer: ZeRO-1 (fp32 main weights and optimizer state for 1/dp).
        overlap_grad_reduce: start each bucket's DP reduction during the last backward. ``None``
            (default) = on, except with manual optimization or an ``on_after_backward`` hook
            (see :mod:`megastrategy.ddp.overlap_policy`); the result is bit-identical either way.
        overlap_param_gather: with ``use_distributed_optimizer``, all-gather the updated
            parameters in the background after the optimizer step and wait for each bucket just
            before its first forward use (checkpoints and evaluation wait for all of them).
        sequence_parallel: split LayerNorm/dropout regions along the sequence over TP ranks.
        activation_checkpointing: ``"full"`` recomputes each block, ``"selective"`` the attention
            core; both replay the dropout streams exactly.
        backend: ``"torch"`` layers, Transformer Engine (``"te"``), or ``"auto"``.
        fp8: Transformer Engine FP8 autocast; amax reduced over the TP and DP ranks.
        cuda_graph_scope: partial CUDA graphs (GPU only) of ``"attn"``, ``"moe_router"``,
            ``"moe_preprocess"``, one set of static buffers per microbatch in flight.
        async_checkpoint: write checkpoints from a background thread; training stalls only for a
            CPU copy of the tensors.
    """

    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    pipeline_schedule: str = "1f1b"
    cp: int = 1
    cp_layout: str = "auto"
    cp_output: str = "auto"
    ep: int = 1
    etp: Optional[int] = None
    num_microbatches: Optional[int] = None
    tp_plan: Optional[Mapping[str, str]] = None
    pipeline_layers: Optional[str] = None
    pipeline_stage_layers: Optional[Sequence[int]] = None
    order: str = DEFAULT_ORDER
    broadcast_batch: Optional[bool] = None
    grad_reduce_in_fp32: bool = True
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    timeout: timedelta = timedelta(minutes=10)
    watchdog: bool = True
    heartbeat_timeout: float = 60.0
    detect_anomalies: bool = False
    on_nonfinite: str = "raise"
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: Optional[bool] = None
    overlap_param_gather: bool = False
    sequence_parallel: bool = False
    activation_checkpointing: Optional[str] = None
    backend: str = "auto"
    fp8: bool = False
    cuda_graph_scope: Any = field(default=None)
    async_checkpoint: bool = False

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_values()
        self._check_features()
        # normalised values, set once (the dataclass is frozen)
        object.__setattr__(self, "etp", self.etp if self.etp is not None else self.tp)
        object.__setattr__(self, "num_microbatches", self.num_microbatches or self.pp)
        object.__setattr__(self, "tp_plan", dict(self.tp_plan) if self.tp_plan is not None else None)
        object.__setattr__(self, "cuda_graph_scope", validate_cuda_graph_scope(
            self.cuda_graph_scope, activation_checkpointing=self.activation_checkpointing
        ))

    # ------------------------------------------------------------------ rules
    def _check_sizes(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MegatronConfigError(f"MegatronStrategy({name}={value!r}): must be a positive integer.")
        if self.ep > 1 and self.cp > 1:  # the rule holds whether or not cp is available
            raise MegatronConfigError(
                f"MegatronStrategy(ep={self.ep}, cp={self.cp}): expert and context parallelism cannot be combined; "
                "use ep > 1 with cp=1 (experts) or cp > 1 with ep=1."
            )
        m = self.num_microbatches
        if m is not None and (not isinstance(m, int) or m < 1):
            raise MegatronConfigError(f"num_microbatches={m!r} must be a positive integer or None (= pp).")

    def _check_values(self) -> None:
        if self.tp_plan is not None and not isinstance(self.tp_plan, Mapping):
            raise MegatronConfigError(
                f"tp_plan={self.tp_plan!r}: expected a dict from module-name globs to "
                "'column' | 'row' | 'vocab' | 'replicate', e.g. {'blocks.*.attn.qkv': 'column'}."
            )
        for name, choices in (("cp_layout", LAYOUT_CHOICES), ("cp_output", OUTPUT_CHOICES)):
            if getattr(self, name) not in choices:
                raise MegatronConfigError(f"MegatronStrategy({name}={getattr(self, name)!r}): use one of {choices}.")
        if self.on_nonfinite not in ("skip", "raise"):
            raise MegatronConfigError(f"on_nonfinite={self.on_nonfinite!r}: use 'skip' or 'raise'.")
        if self.overlap_grad_reduce not in (None, True, False):
            raise MegatronConfigError(
                f"MegatronStrategy(overlap_grad_reduce={self.overlap_grad_reduce!r}): use None (automatic: on unless "
                "manual optimization or an on_after_backward hook), True or False."
            )
        if not isinstance(self.overlap_param_gather, bool):
            raise MegatronConfigError(f"MegatronStrategy(overlap_param_gather={self.overlap_param_gather!r}): use True or False.")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise MegatronConfigError(
                "MegatronStrategy(overlap_param_gather=True, use_distributed_optimizer=False): only the distributed "
                "optimizer gathers parameters after its step. Set use_distributed_optimizer=True, or drop overlap_param_gather."
            )
        if not isinstance(self.async_checkpoint, bool):
            raise MegatronConfigError(
                f"MegatronStrategy(async_checkpoint={self.async_checkpoint!r}): use True (write checkpoints in a "
                "background thread) or False (write them before training continues)."
            )

    def _check_features(self) -> None:
        validate_sequence_parallel(tp=self.tp, sequence_parallel=self.sequence_parallel)
        validate_recompute_mode(self.activation_checkpointing)
        if self.backend not in BACKENDS:
            raise MegatronConfigError(f"backend={self.backend!r}: use one of {', '.join(map(repr, BACKENDS))}.")
        validate_fp8(self.fp8, self.backend)
        validate_pipeline_schedule(self.pipeline_schedule, self.pp, self.vp or 1)
        self._check_stage_layers()
        if self.pipeline_schedule == "zb_v":
            check_zb_v(self.num_microbatches, self.pp)
        if self.pipeline_schedule != "1f1b" and self.cuda_graph_scope:
            raise MegatronConfigError(
                f"MegatronStrategy(pipeline_schedule={self.pipeline_schedule!r}, cuda_graph_scope="
                f"{self.cuda_graph_scope!r}): a captured graph's backward computes input and weight gradients in one "
                "replay of static buffers, which the deferred weight-gradient step would replay again after other "
                "microbatches reused them. Use pipeline_schedule='1f1b' with CUDA graphs, or cuda_graph_scope=None."
            )

    def _check_stage_layers(self) -> None:
        """``pipeline_stage_layers``' shape; whether the counts sum to the model's blocks is checked
        when the model is known (the pipeline component's ``validate``)."""
        counts, stages = self.pipeline_stage_layers, self.pp * self.vp_size
        if counts is None:
            return
        valid = isinstance(counts, (list, tuple)) and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts
        )
        if not valid or len(counts) != stages or self.pp < 2:
            raise MegatronConfigError(
                f"MegatronStrategy(pipeline_stage_layers={counts!r}, pp={self.pp}, vp={self.vp}): the rule is a tuple "
                f"of pp·vp = {stages} positive ints with pp > 1, the blocks of each virtual stage in order, e.g. "
                f"pipeline_stage_layers={tuple([2] * max(stages, 2))} with pp={max(self.pp, 2)}; or None for equal shares."
            )
        object.__setattr__(self, "pipeline_stage_layers", tuple(counts))

    # ------------------------------------------------------------------ derived
    @property
    def should_broadcast_batch(self) -> bool:
        """Broadcast each batch within a model replica: asked for explicitly, or whenever the replica
        spans several ranks (``tp``, ``cp`` or ``pp`` > 1)."""
        return self.broadcast_batch if self.broadcast_batch is not None else self.tp * self.cp * self.pp > 1

    def layout(self, world_size: int) -> ParallelLayout:
        """The rank grid for ``world_size`` processes (raises if the sizes do not fit it)."""
        return ParallelLayout(world_size=world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp,
                              vp=self.vp, order=self.order)

    @property
    def vp_size(self) -> int:
        """Model chunks per pipeline rank: ``vp``, or two under ZB-V (its V needs them, ``vp=None`` included)."""
        return schedule_vp_size(self.pipeline_schedule, self.vp or 1)


def split_strategy_arguments(kwargs: dict[str, Any], lightning_names: set[str]) -> tuple[dict, dict]:
    """(ours, Lightning's): the strategy's keywords split between :class:`MegatronConfig` and
    Lightning's ``DDPStrategy``. A keyword neither knows is refused: ``DDPStrategy`` would pass it
    to a ``DistributedDataParallel`` wrapper this strategy never builds, i.e. silently ignore it."""
    fields = {f.name for f in dataclasses.fields(MegatronConfig)}
    unknown = sorted(k for k in kwargs if k not in fields and k not in lightning_names)
    if unknown:
        raise MegatronConfigError(
            f"MegatronStrategy({', '.join(f'{k}={kwargs[k]!r}' for k in unknown)}): unknown argument(s). "
            f"The strategy takes {sorted(fields)} and Lightning's DDPStrategy arguments {sorted(lightning_names)}."
        )
    ours = {k: v for k, v in kwargs.items() if k in fields}
    return ours, {k: v for k, v in kwargs.items() if k not in fields}
