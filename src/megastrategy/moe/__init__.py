"""Mixture-of-experts layers with expert parallelism (see :mod:`megastrategy.moe.integration`
for what the strategy calls)."""
from megastrategy.moe.layer import MoELayer

__all__ = ["MoELayer"]
