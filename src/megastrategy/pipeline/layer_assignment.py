"""Which transformer layers live on which pipeline rank and model chunk.

With interleaving, rank ``r`` holds ``vp_size`` chunks; chunk ``c`` is virtual stage
``c * pp_size + r``, so the virtual stages run through the ranks ``vp_size`` times (another
:class:`~.placement.StagePlacement`, such as ZB-V's, maps chunks to stages differently).
Every virtual stage holds consecutive layers. When the stages cannot hold equal shares (12 layers
on 5 stages, MiniLM's 6 on 4), the earliest stages take one layer more: the last stage also runs
the head and the loss, and the first only an embedding lookup. The split changes which rank
computes a layer, never what it computes, so the numbers are one device's either way; users who
know better name the counts (``pipeline_stage_layers=(3, 3, 3, 2, 1)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from megastrategy.errors import MegatronConfigError

if TYPE_CHECKING:
    from megastrategy.pipeline.placement import StagePlacement

__all__ = ["assign_layers", "check_positive_int", "stage_layer_counts"]


def check_positive_int(name: str, value: object) -> int:
    """Reject non-integers (bool included) and values < 1 with a message naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MegatronConfigError(
            f"{name}={value!r} must be a positive int (got {type(value).__name__})."
        )
    if value < 1:
        raise MegatronConfigError(f"{name}={value} must be a positive int (>= 1).")
    return value


def _too_few_layers_message(num_layers: int, pp_size: int, vp_size: int) -> str:
    chunks = pp_size * vp_size
    pp_ok = [p for p in range(1, pp_size) if p * vp_size <= num_layers]
    vp_ok = [v for v in range(1, vp_size) if pp_size * v <= num_layers]
    fixes = [f"pp_size <= {max(pp_ok)} (with vp_size={vp_size})"] if pp_ok else []
    fixes += [f"vp_size <= {max(vp_ok)} (with pp_size={pp_size})"] if vp_ok else []
    return (
        f"num_layers={num_layers} cannot fill pp_size={pp_size} x vp_size={vp_size} = {chunks} pipeline stages: "
        f"the rule is num_layers >= pp_size * vp_size, so that every stage holds at least one layer. "
        "Would work: " + ("; or ".join(fixes) if fixes else "pp=1") + "."
    )


def stage_layer_counts(
    num_layers: int, pp_size: int, vp_size: int = 1, requested: "Sequence[int] | None" = None
) -> list[int]:
    """Layers per virtual stage: ``requested`` when the user named them (checked against the
    model), otherwise as equal as possible with the earliest stages taking the remainder."""
    chunks = pp_size * vp_size
    if requested is not None:
        counts = list(requested)
        if len(counts) != chunks or sum(counts) != num_layers:
            raise MegatronConfigError(
                f"pipeline_stage_layers={tuple(counts)} names {len(counts)} stages holding {sum(counts)} layers, but "
                f"the model has num_layers={num_layers} blocks on pp_size={pp_size} x vp_size={vp_size} = {chunks} "
                f"stages: the rule is one positive count per virtual stage, summing to the blocks. Would work: "
                f"{tuple(stage_layer_counts(num_layers, pp_size, vp_size))}, or pipeline_stage_layers=None."
            )
        return counts
    if num_layers < chunks:
        raise MegatronConfigError(_too_few_layers_message(num_layers, pp_size, vp_size))
    share, extra = divmod(num_layers, chunks)
    return [share + (stage < extra) for stage in range(chunks)]


def assign_layers(
    num_layers: int,
    pp_size: int,
    vp_size: int = 1,
    placement: "StagePlacement | None" = None,
    stage_layers: "Sequence[int] | None" = None,
) -> list[list[list[int]]]:
    """Layer indices per ``[pp_rank][chunk]``.

    Virtual stage ``s`` holds the consecutive layers after those of stages ``0 .. s-1``, counted by
    :func:`stage_layer_counts`; chunk ``c`` of rank ``r`` runs stage ``placement.stage(r, c)``
    (default: the ring, ``c * pp_size + r``).
    """
    check_positive_int("num_layers", num_layers)
    check_positive_int("pp_size", pp_size)
    check_positive_int("vp_size", vp_size)
    if placement is not None and (placement.pp_size, placement.vp_size) != (pp_size, vp_size):
        raise MegatronConfigError(
            f"placement {placement.name!r} is for pp_size={placement.pp_size}, vp_size={placement.vp_size}, "
            f"not pp_size={pp_size}, vp_size={vp_size}; build it for the same layout."
        )
    counts = stage_layer_counts(num_layers, pp_size, vp_size, stage_layers)
    starts = [sum(counts[:s]) for s in range(len(counts))]

    def layers(r: int, c: int) -> list[int]:
        s = c * pp_size + r if placement is None else placement.stage(r, c)
        return list(range(starts[s], starts[s] + counts[s]))

    return [[layers(r, c) for c in range(vp_size)] for r in range(pp_size)]
