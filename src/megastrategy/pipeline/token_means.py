"""Token-mean losses over microbatches, as one device computes them over the whole batch.

A loss that is a mean over a data-dependent number of targets (masked LM: the masked tokens;
fine-tuning with prompt or padding labels set to -100) is, per microbatch, the mean over that
microbatch's valid targets. The mean of those means (what Lightning's gradient accumulation
would give) is not the batch's mean once microbatches hold different numbers of valid targets:
a masked LM under pp=2 trained about 1e-2 away from one device. Every rank holds the whole
batch, so the valid targets of every microbatch can be counted before any of them runs.

While the user's step runs on a microbatch, ``F.cross_entropy`` and ``F.nll_loss`` with
``reduction="mean"`` over integer targets return the microbatch's *sum* divided by
``total / m`` (``total``: the batch's valid targets, class-weighted when ``weight=`` is given).
The executor's average over the ``m`` microbatches is then the batch's mean, and so is every
value the step logs per microbatch (combined by batch size). To count, the targets are traced
back to a tensor of the microbatch: the labels themselves, or shifted by one as causal LM losses
shift them (Hugging Face's ``labels=`` included). Targets built otherwise (derived inside the
step) are left alone; if their valid counts differ between microbatches, a warning says so once.
When every microbatch holds the same count nothing is rewritten: the mean already is the batch's.
"""
from __future__ import annotations

import inspect
import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from megastrategy.batch_tree import flatten_batch
from megastrategy.rank_zero import log_on_rank_zero

__all__ = ["TokenMeans"]

_log = logging.getLogger(__name__)
_LOSSES = ("cross_entropy", "nll_loss")


def _same(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return labels.reshape(-1)


def _shifted_padded(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Hugging Face's causal LM loss: label i+1 is position i's target, the last position ignored."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """A causal LM loss shifted by hand (``logits[:, :-1]`` against ``labels[:, 1:]``)."""
    return labels[..., 1:].reshape(-1)


#: how a loss's targets may come from a tensor of the microbatch
_RULES: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "same": _same, "shifted_padded": _shifted_padded, "shifted": _shifted,
}


class TokenMeans:
    """Rewrites mean-reduced token losses inside the user's step (see the module docstring).

    Lives as long as the step runner; :meth:`step` covers one step's microbatches, and
    :meth:`microbatch` marks which one the current thread's user step is running."""

    def __init__(self) -> None:
        self._sources: dict[tuple[str, int], tuple[int, str]] = {}  # (step, call) -> (leaf, rule)
        self._warned: set[tuple[str, int]] = set()
        self._local = threading.local()
        self._leaves: Optional[list[list]] = None
        self._step_name = ""
        self._calls: dict[int, int] = {}  # microbatch -> loss calls so far
        self._counts: dict[int, list] = {}  # call -> every microbatch's valid targets (traced) this step
        self._unresolved: dict[int, dict[int, float]] = {}  # call -> {microbatch: valid targets seen}
        self._untraceable: set[tuple[str, int]] = set()  # (step, call) whose targets are not the batch's
        self._mixed: set[int] = set()  # calls of this step counted in some microbatches and not in others

    @contextmanager
    def step(self, step_name: str, microbatches: list) -> Iterator[None]:
        """Around one pipelined step: the losses of ``F`` are rewritten while it runs."""
        self._leaves = [flatten_batch(mb)[0] for mb in microbatches]
        self._step_name, self._calls, self._counts, self._unresolved, self._mixed = step_name, {}, {}, {}, set()
        originals = {name: getattr(F, name) for name in _LOSSES}
        for name, func in originals.items():
            setattr(F, name, self._wrapped(func))
        try:
            yield
        finally:
            for name, func in originals.items():
                setattr(F, name, func)
            self._leaves = None
        self._warn_unresolved()

    @contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """The current thread runs microbatch ``index``'s user step (entered again after a pause)."""
        outer = getattr(self._local, "index", None)
        self._local.index = index
        try:
            yield
        finally:
            self._local.index = outer

    def _wrapped(self, func: Callable) -> Callable:
        signature = inspect.signature(func)

        def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            index = getattr(self._local, "index", None)
            if index is None or self._leaves is None:
                return func(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return self._loss(func, dict(bound.arguments), index)

        loss.__wrapped__ = func
        return loss

    def _loss(self, func: Callable, params: dict, index: int) -> torch.Tensor:
        reduction = params["reduction"]
        if params.get("size_average") is not None or params.get("reduce") is not None:
            reduction = torch.nn._reduction.legacy_get_string(params["size_average"], params["reduce"])
        target = params["target"]
        if reduction != "mean" or target.is_floating_point():
            return func(**params)
        call = self._calls.get(index, 0)
        self._calls[index] = call + 1
        weight, ignore_index = params.get("weight"), int(params["ignore_index"])
        if weight is not None and params.get("label_smoothing", 0.0):
            return func(**params)  # torch's smoothed, weighted mean has another divisor
        flat = target.reshape(-1)
        source = self._source(call, index, flat, ignore_index)
        if source is None:
            self._unresolved.setdefault(call, {})[index] = float(_valid(flat, weight, ignore_index))
            return func(**params)
        counts = self._counts.get(call)
        if counts is None:
            leaf, rule = source
            counts = self._counts[call] = [
                float(_valid(_RULES[rule](leaves[leaf], ignore_index), weight, ignore_index)) for leaves in self._leaves]
        if all(c == counts[0] for c in counts):
            return func(**params)
        params.update(reduction="sum", size_average=None, reduce=None)
        return func(**params) / (sum(counts) / len(counts))

    def _source(self, call: int, index: int, flat: torch.Tensor, ignore_index: int) -> Optional[tuple[int, str]]:
        """The batch tensor (leaf, rule) giving loss call ``call``'s targets in every microbatch so far.

        Checked on every microbatch: targets built inside the step can equal a batch tensor by
        chance in one microbatch (no padding there) and not in the next; such a call is then
        never rewritten again, and the step that mixed both is reported."""
        key = (self._step_name, call)
        if key in self._untraceable:
            return None
        cached = self._sources.get(key)
        if cached is not None and _matches(self._leaves[index], cached, flat, ignore_index):
            return cached
        if call in self._counts:  # earlier microbatches of this step were counted from that tensor
            self._untraceable.add(key)
            self._mixed.add(call)
            return None
        found = _find_source(self._leaves[index], flat, ignore_index)
        if found is not None:
            self._sources[key] = found
        return found

    def _warn_unresolved(self) -> None:
        for call, seen in self._unresolved.items():
            key = (self._step_name, call)
            mixed = call in self._mixed
            if key in self._warned or (len(set(seen.values())) < 2 and not mixed):
                continue
            self._warned.add(key)
            why = ("its targets came from a tensor of the batch in some microbatches and not in others (built inside "
                   "the step), so this step weighed its microbatches inconsistently and later steps average the "
                   "microbatch means" if mixed else
                   f"it averages over a different number of valid targets in each microbatch "
                   f"({[int(seen[i]) for i in sorted(seen)]}), and its targets are not a tensor of the batch (nor one "
                   "shifted by one), so the batch's count is unknown: the step's loss is the mean of the microbatch means")
            log_on_rank_zero(_log, logging.WARNING, (
                f"megastrategy: a mean-reduced loss in {self._step_name}: {why}, not one device's mean over the batch. "
                "Put the labels in the batch (the collator) and pass them to the model or the loss, or use "
                "MegatronStrategy(num_microbatches=1)."))


def _valid(targets: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int) -> torch.Tensor:
    """The divisor of a mean-reduced cross entropy / NLL over ``targets``."""
    keep = targets != ignore_index
    if weight is None:
        return keep.sum()
    return (weight[targets.clamp(min=0)] * keep).sum()


def _matches(leaves: list, source: tuple[int, str], flat: torch.Tensor, ignore_index: int) -> bool:
    leaf, rule = source
    value = leaves[leaf] if leaf < len(leaves) else None
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() == 0:
        return False
    derived = _RULES[rule](value, ignore_index)
    return derived.shape == flat.shape and derived.device == flat.device and torch.equal(derived, flat)


def _find_source(leaves: list, flat: torch.Tensor, ignore_index: int) -> Optional[tuple[int, str]]:
    """The (leaf, rule) of the microbatch that gives these targets, if one does."""
    for leaf, value in enumerate(leaves):
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() == 0:
            continue
        for rule in _RULES:
            if _matches(leaves, (leaf, rule), flat, ignore_index):
                return leaf, rule
    return None
