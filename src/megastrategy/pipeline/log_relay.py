"""Relay the last stage's ``self.log`` calls to every pipeline stage.

Under pipeline parallelism only the last stage computes losses and reaches the user's
``self.log`` calls, once per microbatch. Those calls are captured there, combined over the
microbatches the way the call's ``reduce_fx`` combines values (:mod:`.log_reduce`), sent to every
stage of the pipeline and replayed on every rank with the whole batch's ``batch_size``: rank 0's
progress bar, loggers and callbacks then see what one device logs for the whole batch, and
``sync_dist`` collectives are entered by every rank (no deadlock) with tensors on the module's
device (NCCL cannot reduce CPU tensors).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.log_reduce import combine_microbatches, microbatch_size

_UNPICKLABLE_LOG_ARGS = ("sync_dist_group",)


class _LogCapture:
    """Records ``self.log`` calls made during the microbatches of one step.

    Plain values are recorded with their microbatch's size (the call's ``batch_size=`` or the
    size Lightning would infer from the microbatch) and combined by :meth:`combined`. A
    torchmetrics object is recorded by its attribute path: the metric itself accumulated every
    microbatch, and its state is shipped to the other stages so that every rank logs an
    identical metric.
    """

    def __init__(self, metric_paths: dict[int, str]) -> None:
        self.calls: dict[str, tuple[list[tuple[float, int]], dict[str, Any]]] = {}
        self.metrics: dict[str, tuple[str, dict[str, Any]]] = {}
        self.metric_step_values: dict[str, list[torch.Tensor]] = {}
        self._metric_paths = metric_paths
        self._microbatch_size = 1

    def begin_microbatch(self, microbatch: Any) -> None:
        """The step runner announces the microbatch whose ``self.log`` calls come next."""
        self._microbatch_size = microbatch_size(microbatch)

    def __call__(self, name: str, value: Any, **kwargs: Any) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in _UNPICKLABLE_LOG_ARGS}
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


_METRIC_EXTRA = ("_forward_cache", "_update_count", "_computed")


def _metric_snapshot(metric, step_value: Optional[torch.Tensor]) -> dict[str, Any]:
    """Everything Lightning reads from a logged metric: its states and the step's value."""
    detach = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    states = {
        k: ([detach(x) for x in v] if isinstance(v, list) else detach(v)) for k, v in metric.metric_state.items()
    }
    snapshot = {"states": states, **{k: detach(getattr(metric, k, None)) for k in _METRIC_EXTRA}}
    if step_value is not None:
        snapshot["_forward_cache"] = step_value
    return snapshot


def _restore_metric(metric, snapshot: dict[str, Any], device: torch.device, *, states: bool) -> None:
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    if states:
        for k, v in snapshot["states"].items():
            setattr(metric, k, [move(x) for x in v] if isinstance(v, list) else move(v))
        for k in _METRIC_EXTRA:
            setattr(metric, k, move(snapshot[k]))
    else:
        metric._forward_cache = move(snapshot["_forward_cache"])


@contextmanager
def capturing_logs(module, metric_paths: dict[int, str]) -> Iterator["_LogCapture"]:
    capture = _LogCapture(metric_paths)
    module.log = capture  # instance attribute shadows LightningModule.log for this step only
    try:
        yield capture
    finally:
        del module.log



def relay_logs(module, capture: Optional[_LogCapture], *, src: int, group, result: Any) -> Any:
    """Send the last stage's captured logs (and the step's ``result``) to every stage and replay them.

    Collective over ``group``; ``capture`` and ``result`` are read on rank ``src`` only. Returns
    ``result`` as seen on ``src``.
    """
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        payload = [
            {
                "logs": capture.combined(),
                "metrics": {
                    name: (path, kw, _metric_snapshot(module.get_submodule(path), capture.metric_step_value(name)))
                    for name, (path, kw) in capture.metrics.items()
                },
                "result": result,
            }
        ]
    dist.broadcast_object_list(payload, src=src, group=group)
    received = payload[0]
    for name, value, kwargs in received["logs"]:
        module.log(name, torch.tensor(value, dtype=torch.float32, device=module.device), **kwargs)
    for name, (path, kwargs, snapshot) in received["metrics"].items():
        metric = module.get_submodule(path)
        _restore_metric(metric, snapshot, module.device, states=dist.get_rank() != src)
        module.log(name, metric, **kwargs)
    return received["result"]
