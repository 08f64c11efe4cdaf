"""The training schedules a user can pick by name (``MegatronStrategy(pipeline_schedule=...)``)."""
from __future__ import annotations

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.schedules import ScheduleStep, schedule_steps
from megastrategy.pipeline.zero_bubble import zb_h1_steps
from megastrategy.pipeline.zero_bubble_v import zb_v_steps

__all__ = ["PIPELINE_SCHEDULES", "microbatches_for", "schedule_placement", "schedule_vp_size", "training_steps",
           "validate_pipeline_schedule"]

#: name -> what it is; "1f1b" is interleaved when vp > 1
PIPELINE_SCHEDULES = {
    "1f1b": "1F1B (interleaved 1F1B with vp > 1)",
    "zb_h1": "ZB-H1 zero bubble: backward split into input (B) and deferred weight (W) gradients; vp=1",
    "zb_v": "ZB-V zero bubble: two chunks per rank in a V (loss on rank 0), B/W split; vp=None or 2",
}

#: schedules whose chunks are not placed on the ring (see :mod:`.placement`)
_PLACEMENT = {"zb_v": "v"}


def _check_name(name: object) -> None:
    if name not in PIPELINE_SCHEDULES:
        allowed = ", ".join(f"{k!r} ({v})" for k, v in PIPELINE_SCHEDULES.items())
        raise MegatronConfigError(f"MegatronStrategy(pipeline_schedule={name!r}): unknown schedule; use one of {allowed}.")


def validate_pipeline_schedule(name: object, pp: int, vp_size: int) -> str:
    """Check ``pipeline_schedule`` against the layout; return the name."""
    _check_name(name)
    if name == "zb_h1" and (pp < 2 or vp_size != 1):
        raise MegatronConfigError(
            f"MegatronStrategy(pipeline_schedule='zb_h1', pp={pp}, vp={vp_size if vp_size > 1 else None}): ZB-H1 runs "
            "one model chunk per pipeline rank, so it needs pp >= 2 and vp=None (or 1). Use pp >= 2 without vp, or "
            "pipeline_schedule='1f1b' (interleaved when vp > 1)."
        )
    if name == "zb_v" and (pp < 2 or vp_size not in (1, 2)):
        raise MegatronConfigError(
            f"MegatronStrategy(pipeline_schedule='zb_v', pp={pp}, vp={vp_size if vp_size > 1 else None}): ZB-V runs "
            "exactly two model chunks per pipeline rank in a V (rank r holds stages r and 2*pp-1-r), so it needs "
            "pp >= 2 and vp=None or 2 (None means 2 here). Use pp >= 2 with vp=None, or pipeline_schedule='1f1b'."
        )
    return str(name)


def schedule_vp_size(name: str, vp_size: int) -> int:
    """Model chunks per rank under ``name``: ZB-V always runs two, whatever ``vp`` left at its default."""
    return 2 if name == "zb_v" else vp_size


def schedule_placement(name: str, pp_size: int, vp_size: int = 1) -> StagePlacement:
    """Which stage each (rank, chunk) runs under the schedule ``name``."""
    _check_name(name)
    return StagePlacement.build(_PLACEMENT.get(name, "ring"), pp_size, schedule_vp_size(name, vp_size))


def training_steps(
    name: str, num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int = 1, group_size: int | None = None
) -> list[ScheduleStep]:
    """This rank's training steps under the schedule ``name``."""
    _check_name(name)
    if name == "zb_h1":
        if vp_size != 1:
            raise MegatronConfigError(f"pipeline_schedule='zb_h1' runs one chunk per rank; got vp_size={vp_size}.")
        return zb_h1_steps(num_microbatches, pp_size, pp_rank)
    if name == "zb_v":
        if vp_size != 2:
            raise MegatronConfigError(f"pipeline_schedule='zb_v' runs two chunks per rank; got vp_size={vp_size}.")
        return zb_v_steps(num_microbatches, pp_size, pp_rank)
    return schedule_steps(num_microbatches, pp_size, pp_rank, vp_size, group_size)


def microbatches_for(batch_size: int, wanted: int, name: str, pp_size: int, pp_rank: int, vp_size: int = 1) -> int:
    """How many microbatches a training batch of ``batch_size`` runs as: ``wanted``, or, when it
    does not divide the batch (the epoch's ragged last batch, since ``DataLoader(drop_last=False)``
    is the default), the largest divisor below it that the schedule can run. Equal microbatches
    keep a per-example mean loss and its gradients exactly what one device computes."""
    if batch_size % wanted == 0:
        return wanted
    for count in sorted((d for d in range(1, wanted) if batch_size % d == 0), reverse=True):
        try:
            training_steps(name, count, pp_size, pp_rank, vp_size)
        except MegatronConfigError:
            continue
        return count
    raise MegatronConfigError(
        f"a training batch of {batch_size} examples cannot be split into equal microbatches that "
        f"pipeline_schedule={name!r} (pp={pp_size}, vp={vp_size}) can run (num_microbatches={wanted}); use a "
        f"DataLoader with drop_last=True, a batch size that is a multiple of {wanted}, or pipeline_schedule='1f1b'."
    )
