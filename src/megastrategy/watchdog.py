"""Make one rank's failure every rank's prompt, named failure instead of a silent hang.

A rank that raises (user code, data loading, out of memory) leaves its peers blocked in a
collective or a pipeline receive until the process-group timeout, with an error that names
nobody. Every rank therefore runs a small thread that talks through the job's rendezvous store:
- it publishes a heartbeat with what the rank is doing ("training_step, batch 12");
- a rank that fails writes one failure record (rank, coordinates, activity, exception);
- every other rank's thread sees the record within a poll interval, prints it, and ends its
  process, so the whole job stops within seconds;
- a rank that dies without a word (SIGKILL, segfault) stops its heartbeat; a peer notices after
  ``heartbeat_timeout`` seconds and writes the failure record for it.

Keys live under a per-fit ``namespace``: a record left by a fit that failed (and whose error the
user caught) must not stop the next fit in the same processes. A failure while ``starting``
(setup: a plan the block check refuses) is usually raised by every rank; a peer gives its own
main thread ``setup_grace`` seconds to raise it too, so that every rank gets the exception
instead of being ended.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

NAMESPACE = "megastrategy"
_DONE = "done"
_STARTING = "starting"


def _failure_key(namespace: str = NAMESPACE) -> str:
    return f"{namespace}/failure"


def _heartbeat_key(rank: int, namespace: str = NAMESPACE) -> str:
    return f"{namespace}/heartbeat/{rank}"


def _ack_key(rank: int, namespace: str = NAMESPACE) -> str:
    return f"{namespace}/failure-read/{rank}"


class FailureWatchdog:
    """Heartbeats and failure records over a ``torch.distributed`` store.

    Args:
        store: the rendezvous store shared by every rank.
        rank, world_size: this process and the job size.
        describe_rank: ``rank -> "rank 3 (tp 1, pp 1, dp 0)"`` for messages.
        poll_interval: seconds between heartbeats and checks.
        heartbeat_timeout: a peer silent this long is declared dead.
        exit_process: how to stop this process when a peer failed (tests replace it).
        namespace: the prefix of every key (one per fit).
        setup_grace: seconds a peer's failure while starting waits for this rank to raise too.
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        *,
        describe_rank: Callable[[int], str],
        poll_interval: float = 0.5,
        heartbeat_timeout: float = 60.0,
        exit_process: Callable[[int], None] = os._exit,
        namespace: str = NAMESPACE,
        setup_grace: float = 5.0,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.describe_rank = describe_rank
        self.poll_interval, self.heartbeat_timeout = poll_interval, heartbeat_timeout
        self._exit = exit_process
        self.namespace, self.setup_grace = namespace, setup_grace
        self.activity = _STARTING
        self._beats = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: dict[int, tuple[bytes, float]] = {}
        self.failure: Optional[str] = None

    # ------------------------------------------------------------------ this rank
    def start(self) -> None:
        if self._thread is None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="megastrategy-watchdog", daemon=True)
            self._thread.start()

    def set_activity(self, text: str) -> None:
        self.activity = text

    def report_failure(self, exc: BaseException) -> str:
        """Publish this rank's failure (the first record wins) and return the job's failure."""
        message = (
            f"{self.describe_rank(self.rank)} failed while {self.activity}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
        return self._publish(message)

    def stop(self) -> None:
        """Normal end: stop beating and tell peers that silence from here is not a failure."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_interval)
            self._thread = None
        try:
            self.store.set(_heartbeat_key(self.rank, self.namespace), _DONE)
        except Exception:  # noqa: BLE001 - the store may already be gone at shutdown
            pass

    def acknowledge(self) -> None:
        """Tell the store host that this rank has the failure record and is stopping."""
        try:
            self.store.set(_ack_key(self.rank, self.namespace), "1")
        except Exception:  # noqa: BLE001 - best effort
            pass

    def linger_until_acknowledged(self, timeout: float) -> None:
        """On the rank that hosts the store: stay until every other rank has read the failure
        record (or is dead or done), so none of them is left to guess."""
        deadline = time.monotonic() + timeout
        waiting = set(range(self.world_size)) - {self.rank}
        while waiting and time.monotonic() < deadline:
            for peer in list(waiting):
                try:
                    acked = self.store.check([_ack_key(peer, self.namespace)])
                    done = self.store.check([_heartbeat_key(peer, self.namespace)]) and self.store.get(_heartbeat_key(peer, self.namespace)) == _DONE.encode()
                except Exception:  # noqa: BLE001
                    return
                if acked or done or peer in self._stale_peers():
                    waiting.discard(peer)
            time.sleep(self.poll_interval / 2)

    def wait_for_diagnosis(self, timeout: float) -> Optional[str]:
        """After losing a peer (connection closed), give the heartbeats time to name the lost rank."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self._read_failure()
            if found:
                return found
            dead = self._stale_peers()
            if dead:
                return self._publish(self._silence_message(dead[0]))
            time.sleep(self.poll_interval)
        return None

    # ------------------------------------------------------------------ internals
    def _publish(self, message: str) -> str:
        try:
            if not self.store.check([_failure_key(self.namespace)]):
                self.store.compare_set(_failure_key(self.namespace), "", message)
            current = self._read_failure()
            self.failure = current or message
            self.acknowledge()
        except Exception:  # noqa: BLE001 - store unreachable: at least keep the local message
            self.failure = message
        return self.failure

    def _read_failure(self) -> Optional[str]:
        try:
            if self.store.check([_failure_key(self.namespace)]):
                return self.store.get(_failure_key(self.namespace)).decode()
        except Exception:  # noqa: BLE001
            return None
        return None

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(_heartbeat_key(self.rank, self.namespace), f"{self._beats}|{self.activity}")

    def _stale_peers(self) -> list[int]:
        now, stale = time.monotonic(), []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            try:
                value = self.store.get(_heartbeat_key(peer, self.namespace)) if self.store.check([_heartbeat_key(peer, self.namespace)]) else b""
            except Exception:  # noqa: BLE001
                return []
            if value == _DONE.encode():
                continue
            last_value, since = self._seen.get(peer, (None, now))
            if value != last_value:
                self._seen[peer] = (value, now)
            elif now - since > self.heartbeat_timeout:
                stale.append(peer)
        return stale

    def _silence_message(self, peer: int) -> str:
        _, activity = (self._seen.get(peer, (b"?|unknown", 0))[0].decode() + "|").split("|")[:2]
        return (
            f"{self.describe_rank(peer)} stopped responding (no heartbeat for {self.heartbeat_timeout:g}s: "
            f"killed, crashed or frozen) while {activity or 'unknown'}"
        )

    def _stop_here(self, failure: str) -> None:
        self.acknowledge()
        sys.stderr.write(
            f"\n[megastrategy] stopping {self.describe_rank(self.rank)} (was {self.activity}) because {failure}\n"
        )
        sys.stderr.flush()
        if self.rank == 0:  # the store lives in this process: let every peer read the record first
            self.linger_until_acknowledged(timeout=self.heartbeat_timeout + 10)
        self._exit(1)

    def _raised_here_too(self, found: str) -> bool:
        """Whether this rank's main thread, given ``setup_grace`` after a peer failed while
        starting, raised as well (then its exception reaches the user; nothing to stop)."""
        if f" failed while {_STARTING}: " not in found:
            return False
        deadline = time.monotonic() + self.setup_grace
        while self.failure is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(self.poll_interval / 2)
        return self.failure is not None or self._stop.is_set()

    def _run(self) -> None:
        store_lost_since: Optional[float] = None
        while not self._stop.wait(self.poll_interval):
            try:
                self._beat()
                store_lost_since = None
            except Exception:  # noqa: BLE001 - the store lives in rank 0's process
                store_lost_since = store_lost_since or time.monotonic()
                if time.monotonic() - store_lost_since > self.heartbeat_timeout:
                    self._stop_here(f"{self.describe_rank(0)} (host of the rendezvous store) is gone")
                continue
            found = self._read_failure()
            if found and self.failure is None and self._raised_here_too(found):
                continue
            if found and self.failure is None:
                self.failure = found
                self._stop_here(found)
                return
            dead = self._stale_peers()
            if dead and self.failure is None:
                self._stop_here(self._publish(self._silence_message(dead[0])))
                return
