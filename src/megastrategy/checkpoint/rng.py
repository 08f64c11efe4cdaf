"""Every random stream a rank draws from, captured into and restored from a checkpoint.

A resumed run repeats the uninterrupted one only if each rank continues from the random
state it had when the checkpoint was taken. Ranks do not share that state: pipeline stages
run different dropout layers and TP ranks own different model-parallel streams, so the
states are saved per global rank (``meta/rank_state/<rank>``, see :mod:`.sharded`).

The streams: torch's CPU generator, every CUDA device's generator (when CUDA is up),
Python's ``random``, NumPy's legacy global generator (when NumPy is installed) and the
:class:`~megastrategy.layers.random.ModelParallelRNGTracker`'s model-parallel stream.
"""
from __future__ import annotations

import random
from typing import Any, Optional

import torch

__all__ = ["capture_rng_states", "restore_rng_states"]


def capture_rng_states(tracker: Optional[Any] = None) -> dict[str, Any]:
    """This process's random states as data only (CPU tensors, numbers, strings), which the
    checkpoint's restricted unpickler reads back without trusting any type."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        states["numpy"] = _numpy_state_as_data(numpy.random.get_state())
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    if tracker is not None and tracker.is_initialized:
        states["model_parallel"] = tracker.get_state()
    return states


def restore_rng_states(states: dict[str, Any], tracker: Optional[Any] = None) -> None:
    """Put back what :func:`capture_rng_states` returned (streams it did not record are left alone)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "python" in states:
        random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        saved = states["cuda"]
        if len(saved) != torch.cuda.device_count():
            raise RuntimeError(
                f"the checkpoint holds random states for {len(saved)} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}; resume with the same devices per process for an exact resume."
            )
        torch.cuda.set_rng_state_all(saved)
    if "numpy" in states:
        try:
            import numpy

            numpy.random.set_state(_numpy_state_from_data(states["numpy"]))
        except ImportError:  # pragma: no cover
            pass
    if "model_parallel" in states and tracker is not None:
        tracker.set_state(states["model_parallel"])


def _numpy_state_as_data(state: tuple) -> dict[str, Any]:
    """NumPy's legacy state tuple without its ``ndarray`` (a type a data-only unpickler refuses)."""
    kind, keys, pos, has_gauss, cached = state
    return {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _numpy_state_from_data(data: Any) -> tuple:
    if isinstance(data, tuple):  # a checkpoint written before states were stored as data
        return data
    keys = data["keys"].numpy().astype("uint32")
    return data["kind"], keys, data["pos"], data["has_gauss"], data["cached_gaussian"]
