"""Turn the per-microbatch ``self.log`` calls of a pipelined step into the whole batch's calls.

Under pipeline parallelism every rank runs the user's step once per microbatch (the stages before
the last finish it with the model outputs relayed from it, :mod:`.model_calls`), so each rank makes the same
``self.log`` calls with the same values, once per microbatch. They are captured, combined over the
microbatches the way the call's ``reduce_fx`` combines values (:mod:`.log_reduce`), and replayed on
the rank once, with the whole batch's ``batch_size``: rank 0's progress bar, loggers and callbacks
then see what one device logs for the whole batch, and ``sync_dist`` collectives are entered by
every rank (no deadlock) with tensors on the module's device (NCCL cannot reduce CPU tensors).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.log_reduce import combine_microbatches, microbatch_size

class _LogCapture:
    """Records ``self.log`` calls made during the microbatches of one step.

    Plain values are recorded with their microbatch's size (the call's ``batch_size=`` or the
    size Lightning would infer from the microbatch) and combined by :meth:`combined`. A
    torchmetrics object is recorded by its attribute path: the metric itself accumulated every
    microbatch, on every rank alike.
    """

    def __init__(self, metric_paths: dict[int, str]) -> None:
        self.calls: dict[str, tuple[list[tuple[float, int]], dict[str, Any]]] = {}
        self.metrics: dict[str, tuple[str, dict[str, Any]]] = {}
        self.metric_step_values: dict[str, list[torch.Tensor]] = {}
        self._metric_paths = metric_paths
        self._microbatch_size = 1
        self._keep = True

    def begin_microbatch(self, microbatch: Any, keep: bool = True) -> None:
        """The step runner announces the microbatch whose ``self.log`` calls come next, and
        whether they count (a run that ends at a stage cut of an earlier chunk repeats calls made
        before the model call)."""
        self._microbatch_size = microbatch_size(microbatch) if keep else 1
        self._keep = keep

    def __call__(self, name: str, value: Any, **kwargs: Any) -> None:
        if not self._keep:
            return
        if id(value) in self._metric_paths:
            self.metrics[name] = (self._metric_paths[id(value)], kwargs)
            if isinstance(value._forward_cache, torch.Tensor):  # this microbatch's value
                self.metric_step_values.setdefault(name, []).append(value._forward_cache.detach().float())
            return
        if not isinstance(value, (torch.Tensor, int, float)):
            raise MegatronConfigError(
                f"self.log({name!r}, {type(value).__name__}) under pipeline parallelism: log a number, a tensor, "
                "or a torchmetrics Metric that is an attribute of the LightningModule."
            )
        value = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
        size = kwargs.get("batch_size")
        values, _ = self.calls.setdefault(name, ([], kwargs))
        values.append((value, int(size) if size is not None else self._microbatch_size))

    def combined(self) -> list[tuple[str, float, dict[str, Any]]]:
        """Each name's value for the whole batch, with the whole batch's ``batch_size``."""
        out = []
        for name, (values, kwargs) in self.calls.items():
            value, total = combine_microbatches(name, values, kwargs.get("reduce_fx", "mean"))
            out.append((name, value, {**kwargs, "batch_size": total}))
        return out

    def metric_step_value(self, name: str) -> Optional[torch.Tensor]:
        """The step's value of a logged metric: the mean of its microbatch values (exact for
        averaged metrics such as accuracy, since microbatches have equal sizes)."""
        values = self.metric_step_values.get(name)
        return torch.stack(values).mean(0).cpu() if values else None


def metric_paths(module) -> dict[int, str]:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return {}
    return {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}


@contextmanager
def capturing_logs(module, metric_paths: dict[int, str]) -> Iterator["_LogCapture"]:
    capture = _LogCapture(metric_paths)
    module.log = capture  # instance attribute shadows LightningModule.log for this step only
    try:
        yield capture
    finally:
        del module.log


def replay_logs(module, capture: _LogCapture) -> None:
    """Make the step's combined ``self.log`` calls on the module, once for the whole batch."""
    for name, value, kwargs in capture.combined():
        module.log(name, torch.tensor(value, dtype=torch.float32, device=module.device), **kwargs)
    for name, (path, kwargs) in capture.metrics.items():
        metric = module.get_submodule(path)
        step_value = capture.metric_step_value(name)
        if step_value is not None:  # what Lightning logs on_step: the batch's value, not the last microbatch's
            metric._forward_cache = step_value.to(module.device)
        module.log(name, metric, **kwargs)
