"""Which transformer layers live on which pipeline rank and model chunk.

With interleaving, rank ``r`` holds ``vp_size`` chunks; chunk ``c`` is virtual stage
``c * pp_size + r``, so the virtual stages run through the ranks ``vp_size`` times (another
:class:`~.placement.StagePlacement`, such as ZB-V's, maps chunks to stages differently).
Every chunk gets the same number of consecutive layers: unequal chunks would make the
slowest stage set the pace of the whole pipeline, so an uneven split is refused rather
than silently accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megastrategy.errors import MegatronConfigError

if TYPE_CHECKING:
    from megastrategy.pipeline.placement import StagePlacement

__all__ = ["assign_layers", "check_positive_int"]


def check_positive_int(name: str, value: object) -> int:
    """Reject non-integers (bool included) and values < 1 with a message naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MegatronConfigError(
            f"{name}={value!r} must be a positive int (got {type(value).__name__})."
        )
    if value < 1:
        raise MegatronConfigError(f"{name}={value} must be a positive int (>= 1).")
    return value


def _nearest(candidates: list[int], target: int, count: int = 4) -> list[int]:
    return sorted(sorted(candidates, key=lambda c: (abs(c - target), c))[:count])


def _fmt(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def _uneven_split_message(num_layers: int, pp_size: int, vp_size: int) -> str:
    chunks = pp_size * vp_size
    lower = (num_layers // chunks) * chunks
    layer_choices = [v for v in (lower, lower + chunks) if v > 0]
    pp_choices = _nearest([p for p in range(1, num_layers + 1) if num_layers % (p * vp_size) == 0], pp_size)
    vp_choices = _nearest([v for v in range(1, num_layers + 1) if num_layers % (pp_size * v) == 0], vp_size)
    parts = [f"num_layers in {_fmt(layer_choices)}"]
    if pp_choices:
        parts.append(f"pp_size in {_fmt(pp_choices)} (with vp_size={vp_size})")
    if vp_choices:
        parts.append(f"vp_size in {_fmt(vp_choices)} (with pp_size={pp_size})")
    return (
        f"num_layers={num_layers} cannot be split evenly into pp_size={pp_size} x vp_size={vp_size} "
        f"= {chunks} model chunks: the rule is num_layers % (pp_size * vp_size) == 0, so that every "
        f"chunk holds the same number of consecutive layers. Would work: " + "; or ".join(parts) + "."
    )


def assign_layers(
    num_layers: int, pp_size: int, vp_size: int = 1, placement: "StagePlacement | None" = None
) -> list[list[list[int]]]:
    """Layer indices per ``[pp_rank][chunk]``.

    Virtual stage ``s`` holds the ``num_layers // (pp_size * vp_size)`` consecutive layers starting
    at ``s * num_layers // (pp_size * vp_size)``; chunk ``c`` of rank ``r`` runs stage
    ``placement.stage(r, c)`` (default: the ring, ``c * pp_size + r``).
    """
    check_positive_int("num_layers", num_layers)
    check_positive_int("pp_size", pp_size)
    check_positive_int("vp_size", vp_size)
    if placement is not None and (placement.pp_size, placement.vp_size) != (pp_size, vp_size):
        raise MegatronConfigError(
            f"placement {placement.name!r} is for pp_size={placement.pp_size}, vp_size={placement.vp_size}, "
            f"not pp_size={pp_size}, vp_size={vp_size}; build it for the same layout."
        )
    if num_layers % (pp_size * vp_size) != 0:
        raise MegatronConfigError(_uneven_split_message(num_layers, pp_size, vp_size))
    per_chunk = num_layers // (pp_size * vp_size)

    def stage(r: int, c: int) -> int:
        return c * pp_size + r if placement is None else placement.stage(r, c)

    return [
        [list(range(stage(r, c) * per_chunk, (stage(r, c) + 1) * per_chunk)) for c in range(vp_size)]
        for r in range(pp_size)
    ]
