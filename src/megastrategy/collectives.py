"""The fused collectives under whichever name this torch gives them, and one way to fall back.

torch renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to
``all_gather_single``/``reduce_scatter_single``; some backends (gloo on some builds) refuse them.
The layers, the gradient buffer, the distributed optimizer and the pipeline all use them with a
fallback to the list forms, so the name lookup and the "backend refused it" test live here once.
Each caller keeps its own set of refused collectives (no state here).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single", "is_unsupported_error", "try_fused"]

#: ``(output, input, group=...)``: every rank's input concatenated into one flat output (None if absent)
all_gather_single: Optional[Callable[..., Any]] = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
#: ``(output, input, op=..., group=...)``: the input summed over ranks, this rank's slice kept
reduce_scatter_single: Optional[Callable[..., Any]] = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)


def is_unsupported_error(err: Exception) -> bool:
    """Does ``err`` say the backend does not implement the collective (rather than a real failure)?"""
    msg = str(err).lower()
    return isinstance(err, NotImplementedError) or any(
        s in msg for s in ("not supported", "unsupported", "does not support", "not implemented")
    )


def try_fused(name: str, fn: Optional[Callable[..., Any]], refused: set[str], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
    """Call the fused collective ``fn(*args, **kwargs)`` unless ``name`` is in ``refused``.

    Returns ``(True, result)``; or ``(False, None)`` when ``fn`` is missing, was refused before, or
    the backend refuses it now (``name`` is then added to ``refused`` so later calls go straight
    to the caller's fallback). Any other error propagates.
    """
    if fn is None or name in refused:
        return False, None
    try:
        return True, fn(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as err:
        if not is_unsupported_error(err):
            raise
        refused.add(name)
        return False, None
