"""Random-number streams for tensor parallelism.

Two streams exist on every rank:

* the **default stream**: the ordinary torch generator of the device. Lightning's
  ``seed_everything`` seeds it identically on every rank, so dropout on *replicated*
  activations (the residual stream, anything every TP rank holds in full) drops the same
  elements on every TP rank, as it must;
* the **model-parallel stream**, owned by a :class:`ModelParallelRNGTracker` and seeded
  with ``base_seed + 2718 + tp_rank``: dropout on *TP-sharded* activations (attention
  probabilities of the local heads, the local slice of the FFN hidden layer) runs on it,
  so that the shards of one logical tensor do not share a mask.

:func:`checkpoint` is an activation checkpoint that replays both streams on recompute, and
:class:`TensorParallelRegionDropout` is a drop-in ``nn.Dropout`` that runs on the
model-parallel stream.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

__all__ = [
    "MODEL_PARALLEL_SEED_OFFSET",
    "ModelParallelRNGTracker",
    "checkpoint",
    "TensorParallelRegionDropout",
]

#: the model-parallel stream of TP rank ``r`` is seeded with ``base_seed + 2718 + r``
MODEL_PARALLEL_SEED_OFFSET = 2718

_STATE_KEY = "model_parallel_rng_state"


def _default_rng_state(device: torch.device) -> Tensor:
    """State of the default generator of ``device`` (a CPU uint8 tensor)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        raise RuntimeError(f"no default random generator known for device type {device.type!r}")
    try:
        return module.get_rng_state(device)
    except TypeError:  # e.g. mps: one generator, no device argument
        return module.get_rng_state()


def _set_default_rng_state(state: Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
        return
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
        return
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "set_rng_state"):
        raise RuntimeError(f"no default random generator known for device type {device.type!r}")
    try:
        module.set_rng_state(state, device)
    except TypeError:
        module.set_rng_state(state)


class ModelParallelRNGTracker:
    """Owns the model-parallel random stream of one TP rank on one device.

    The stream is not a global: the strategy creates one tracker per process and hands it
    to the layers that need it. The state lives in this object while the stream is idle
    and in the device's default generator while :meth:`fork` is active.

    Args:
        tp_rank: this process's rank inside its tensor-parallel group.
        device: the device whose default generator :meth:`fork` swaps (``cpu`` or
            ``cuda:i``); use the device the sharded activations live on.
    """

    def __init__(self, *, tp_rank: int, device: torch.device | str) -> None:
        if int(tp_rank) < 0:
            raise ValueError(f"tp_rank must be >= 0, got {tp_rank}")
        self.tp_rank = int(tp_rank)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._state: Tensor | None = None
        self._forked = False
        self._seed: int | None = None

    # -- introspection -------------------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        """True once :meth:`seed` or :meth:`set_state` gave the stream a state."""
        return self._state is not None

    @property
    def is_forked(self) -> bool:
        """True while the body of :meth:`fork` runs."""
        return self._forked

    @property
    def initial_seed(self) -> int | None:
        """The seed the stream was last seeded with (``None`` before :meth:`seed`)."""
        return self._seed

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tp_rank={self.tp_rank}, device={self.device}, "
            f"initialized={self.is_initialized})"
        )

    # The tracker is a per-process resource shared by every layer that uses it (like a
    # process group); copying a module must not split the stream into independent copies
    # that would then repeat each other's masks.
    def __copy__(self) -> "ModelParallelRNGTracker":
        return self

    def __deepcopy__(self, memo: dict) -> "ModelParallelRNGTracker":
        return self

    # -- seeding and checkpointing -------------------------------------------------------
    def seed(self, base_seed: int) -> None:
        """Seed the model-parallel stream with ``base_seed + 2718 + tp_rank``.

        Does not touch the default generator. Call with the same ``base_seed`` that seeded
        the default stream (e.g. the one given to ``seed_everything``).
        """
        if self._forked:
            raise RuntimeError("ModelParallelRNGTracker.seed() called inside fork()")
        seed = int(base_seed) + MODEL_PARALLEL_SEED_OFFSET + self.tp_rank
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self._state = generator.get_state()
        self._seed = seed

    def _current_state(self) -> Tensor:
        """The live state (inside :meth:`fork` it sits in the default generator)."""
        if self._state is None:
            raise RuntimeError(self._uninitialized_message())
        if self._forked:
            return _default_rng_state(self.device)
        return self._state

    def _install_state(self, state: Tensor) -> None:
        if self._forked:
            _set_default_rng_state(state, self.device)
        self._state = state

    def get_state(self) -> dict[str, Tensor]:
        """A copy of the stream's state, for checkpoints (``{}`` before it is seeded)."""
        if self._state is None:
            return {}
        return {_STATE_KEY: self._current_state().clone()}

    def set_state(self, state: dict[str, Tensor]) -> None:
        """Restore a state produced by :meth:`get_state` (``{}`` un-initializes)."""
        if not state:
            if self._forked:
                raise RuntimeError("cannot clear the tracker's state inside fork()")
            self._state = None
            self._seed = None
            return
        if _STATE_KEY not in state:
            raise KeyError(
                f"ModelParallelRNGTracker.set_state expects a dict with key {_STATE_KEY!r} "
                f"(as returned by get_state()), got keys {sorted(state)}"
            )
        tensor = state[_STATE_KEY]
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{_STATE_KEY} must be a tensor, got {type(tensor).__name__}")
        self._install_state(tensor.detach().to(device="cpu", dtype=torch.uint8).clone())

    def _uninitialized_message(self) -> str:
        return (
            "the model-parallel RNG stream has no state: call ModelParallelRNGTracker.seed(base_seed) "
            "(the strategy does this when the run is seeded, e.g. by seed_everything) or "
            "set_state(...) before running dropout on tensor-parallel activations"
        )

    # -- the stream ------------------------------------------------------------------------
    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on the model-parallel stream.

        Saves the default generator's state of :attr:`device`, installs the tracker's
        state, runs the body, keeps the advanced state and restores the default state, so
        the default stream is exactly as if the body had drawn nothing. Nested ``fork()``
        of the same tracker is a no-op (the body already runs on the stream).
        """
        if self._forked:
            yield
            return
        if self._state is None:
            raise RuntimeError(self._uninitialized_message())
        default_state = _default_rng_state(self.device)
        _set_default_rng_state(self._state, self.device)
        self._forked = True
        try:
            yield
        finally:
            self._state = _default_rng_state(self.device)
            self._forked = False
            _set_default_rng_state(default_state, self.device)


class _Snapshot:
    """Forward context of :func:`checkpoint`: records both streams as the forward starts."""

    def __init__(self, tracker: ModelParallelRNGTracker) -> None:
        self.tracker = tracker
        self.tracker_state: Tensor | None = None
        self.default_state: Tensor | None = None

    def __enter__(self) -> None:
        if self.tracker.is_forked:
            raise RuntimeError(
                "megastrategy.layers.random.checkpoint was called inside rng_tracker.fork(); "
                "call it outside the fork and fork inside the checkpointed function instead"
            )
        if self.tracker.is_initialized:
            self.tracker_state = self.tracker._current_state().clone()
        self.default_state = _default_rng_state(self.tracker.device).clone()

    def __exit__(self, *exc: Any) -> None:
        return None


class _Replay:
    """Recompute context of :func:`checkpoint`: re-installs the snapshot, then restores.

    Reusable: a graph kept with ``retain_graph=True`` recomputes once per backward.
    """

    def __init__(self, snapshot: _Snapshot) -> None:
        self.snapshot = snapshot
        self._saved: list[tuple[Tensor | None, Tensor]] = []

    def __enter__(self) -> None:
        tracker = self.snapshot.tracker
        live_tracker = tracker._current_state().clone() if tracker.is_initialized else None
        live_default = _default_rng_state(tracker.device).clone()
        self._saved.append((live_tracker, live_default))
        if self.snapshot.tracker_state is not None:
            tracker._install_state(self.snapshot.tracker_state.clone())
        # torch's preserve_rng_state covers the CPU generator and the devices of the
        # tensor arguments; replay the tracker's device too, whatever the arguments were.
        if self.snapshot.default_state is not None:
            _set_default_rng_state(self.snapshot.default_state, tracker.device)

    def __exit__(self, *exc: Any) -> None:
        tracker = self.snapshot.tracker
        live_tracker, live_default = self._saved.pop()
        if live_tracker is not None:
            tracker._install_state(live_tracker)
        _set_default_rng_state(live_default, tracker.device)
        return None


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    rng_tracker: ModelParallelRNGTracker | None = None,
    **kwargs: Any,
) -> Any:
    """Activation checkpointing that replays the default AND the model-parallel stream.

    ``function(*args, **kwargs)`` runs without keeping its activations; in backward it is
    recomputed with the default generators (CPU, the argument devices and
    ``rng_tracker.device``) and the tracker's stream set to the states they had when the
    original forward started, so dropout masks (shared and per-TP-rank) are identical.
    Afterwards every stream is put back where it was before the recompute, so the next
    microbatch sees the streams as the original forwards left them.

    Uses non-reentrant ``torch.utils.checkpoint.checkpoint``: tensors captured by
    ``function`` (parameters, closures) receive gradients, and ``kwargs`` are passed on
    (names reserved by torch's checkpoint -- ``preserve_rng_state``, ``context_fn``,
    ``determinism_check``, ``debug``, ``use_reentrant``, ``early_stop`` -- cannot be).
    """
    if rng_tracker is None:
        return _torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    def context_fn() -> tuple[_Snapshot, _Replay]:
        snapshot = _Snapshot(rng_tracker)
        return snapshot, _Replay(snapshot)

    return _torch_checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=context_fn,
        **kwargs,
    )


class TensorParallelRegionDropout(nn.Dropout):
    """``nn.Dropout`` on TP-sharded activations: draws its mask from the tracker's stream.

    Keeps ``p`` and ``inplace`` and respects ``self.training`` like ``nn.Dropout`` (it is
    one, so ``isinstance(m, nn.Dropout)`` code keeps working). In eval mode, or with
    ``p == 0``, the input is returned unchanged and no stream is touched.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, rng_tracker: ModelParallelRNGTracker) -> None:
        super().__init__(p=p, inplace=inplace)
        if not isinstance(rng_tracker, ModelParallelRNGTracker):
            raise TypeError(
                "TensorParallelRegionDropout needs rng_tracker=ModelParallelRNGTracker(...), "
                f"got {type(rng_tracker).__name__}"
            )
        self.rng_tracker = rng_tracker

    @classmethod
    def from_dropout(cls, dropout: nn.Dropout, rng_tracker: ModelParallelRNGTracker) -> "TensorParallelRegionDropout":
        """Wrap the user's ``nn.Dropout`` (same ``p``, ``inplace`` and train/eval mode)."""
        if not isinstance(dropout, nn.Dropout):
            raise TypeError(
                f"TensorParallelRegionDropout.from_dropout expects an nn.Dropout, got {type(dropout).__name__}"
            )
        if isinstance(dropout, TensorParallelRegionDropout):
            return dropout
        module = cls(p=dropout.p, inplace=dropout.inplace, rng_tracker=rng_tracker)
        module.train(dropout.training)
        return module

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return input
        with self.rng_tracker.fork():
            return F.dropout(input, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, rng=model-parallel"
