"""Lightning's ``ThroughputMonitor`` counts data-parallel replicas, not processes.

The monitor's global rates are one device's times ``trainer.world_size`` (``samples_per_sec``,
``batches_per_sec``, ``items_per_sec``; the total ``flops_per_sec`` sums each device's
``flops_per_batch``). Under tensor, pipeline or context parallelism the ranks of one replica work
on the same samples, so that product counts each sample tp·pp·cp times: a tp2 job on one replica
reported twice the samples it trained on. The monitor's ``Throughput`` objects are made in the
callback's ``setup``, before the strategy's; the strategy then gives them the data-parallel size.
Per-device FLOPs and MFU stay as Lightning computes them from the module's ``flops_per_batch``
(the whole replica's work: divide by tp·pp for a device's share).
"""
from __future__ import annotations

from lightning.pytorch.callbacks import ThroughputMonitor

__all__ = ["count_replicas"]


def count_replicas(callbacks: list, dp_size: int) -> None:
    for callback in callbacks:
        if isinstance(callback, ThroughputMonitor):
            for throughput in callback._throughputs.values():
                throughput.world_size = dp_size
