"""Pipeline parallelism: layer placement, per-rank schedules, and a timing simulator."""

from megastrategy.pipeline.layer_assignment import assign_layers
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.schedule_choice import (
    PIPELINE_SCHEDULES,
    schedule_placement,
    training_steps,
    validate_pipeline_schedule,
)
from megastrategy.pipeline.schedules import (
    ScheduleStep,
    StepPart,
    forward_only_order,
    forward_only_steps,
    num_warmup_steps,
    schedule_order,
    schedule_steps,
    validate_schedule,
)
from megastrategy.pipeline.simulator import (
    PipelineDeadlockError,
    ScheduleStats,
    StepTiming,
    draw_timeline,
    simulate_schedule,
    simulate_steps,
)
from megastrategy.pipeline.zero_bubble import zb_h1_steps
from megastrategy.pipeline.zero_bubble_v import zb_v_steps

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineDeadlockError",
    "ScheduleStats",
    "ScheduleStep",
    "StagePlacement",
    "StepPart",
    "StepTiming",
    "assign_layers",
    "draw_timeline",
    "forward_only_order",
    "forward_only_steps",
    "num_warmup_steps",
    "schedule_order",
    "schedule_placement",
    "schedule_steps",
    "simulate_schedule",
    "simulate_steps",
    "training_steps",
    "validate_pipeline_schedule",
    "validate_schedule",
    "zb_h1_steps",
    "zb_v_steps",
]

from megastrategy.pipeline.executor import PipelineExecutor  # noqa: E402
from megastrategy.pipeline.p2p import PipelineCommunicator, RecvHandle  # noqa: E402

__all__ += ["PipelineCommunicator", "PipelineExecutor", "RecvHandle"]
