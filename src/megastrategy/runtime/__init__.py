"""Run-time services as strategy components: the failure watchdog and the TP batch broadcast."""
from megastrategy.runtime.batch_broadcast import BatchBroadcast
from megastrategy.runtime.watchdog import Watchdog

__all__ = ["BatchBroadcast", "Watchdog"]
