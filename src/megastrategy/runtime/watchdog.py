"""The failure watchdog (:mod:`megastrategy.watchdog`) as a component: started once the groups
exist, told what the rank is doing, and asked to name the failing rank when a step raises."""
from __future__ import annotations

import itertools
import logging
from typing import Optional

from megastrategy.component import Component, Environment
from megastrategy.config import MegatronConfig
from megastrategy.rank_zero import log_on_rank_zero
from megastrategy.watchdog import NAMESPACE, FailureWatchdog

log = logging.getLogger(__name__)

#: numbers the fits of this process: every rank runs the same fits in the same order, so the
#: n-th fit's keys match across ranks and a failed earlier fit's record is not read again
_FITS = itertools.count()
_LOST_PEER = ("Connection closed by peer", "Connection reset", "Broken pipe", "Socket closed")


class Watchdog(Component):
    """``watchdog=True``: when a rank fails, every rank stops within seconds naming it."""

    def __init__(self, config: MegatronConfig) -> None:
        self.enabled = config.watchdog
        self.heartbeat_timeout = config.heartbeat_timeout
        self.watchdog: Optional[FailureWatchdog] = None
        self._rank = 0

    def on_environment(self, env: Environment) -> None:
        if self.watchdog is not None or env.world_size == 1:
            return
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception as err:  # noqa: BLE001 - an init method without a store
            message = f"megastrategy: no rendezvous store ({err}); failures will surface at the collective timeout"
            log_on_rank_zero(log, logging.WARNING, message)
            return
        layout = env.layout

        def describe(rank: int) -> str:
            c = layout.dense_generator().coordinates(rank)
            return f"rank {rank} (tp {c['tp']}, pp {c['pp']}, dp {c['dp']})"

        self._rank = env.global_rank
        self.watchdog = FailureWatchdog(
            store, env.global_rank, env.world_size, describe_rank=describe, heartbeat_timeout=self.heartbeat_timeout,
            namespace=f"{NAMESPACE}/fit{next(_FITS)}",
        )
        self.watchdog.start()

    def on_activity(self, text: str) -> None:
        if self.watchdog is not None:
            self.watchdog.set_activity(text)

    def on_exception(self, exception: BaseException) -> None:
        if self.watchdog is None:
            return
        if any(s in str(exception) for s in _LOST_PEER):
            # We lost a peer; wait for the heartbeats to say which one, then name it.
            found = self.watchdog.wait_for_diagnosis(self.heartbeat_timeout + 5)
        else:
            found = self.watchdog.report_failure(exception)
        if self._rank == 0:  # the store lives here: let peers read the record before it goes
            self.watchdog.linger_until_acknowledged(timeout=self.heartbeat_timeout + 10)
        if found and hasattr(exception, "add_note"):
            exception.add_note(f"[megastrategy] {found}")

    def teardown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.watchdog = None
