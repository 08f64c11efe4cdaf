"""The failure watchdog on one shared in-memory store, ranks as threads (no processes needed)."""
import threading
import time

import pytest
from torch.distributed import HashStore

from megastrategy.watchdog import FailureWatchdog, _ack_key

pytestmark = pytest.mark.timeout(60)


class _Exits:
    def __init__(self):
        self.codes, self.when = {}, {}

    def for_rank(self, rank):
        def exit_process(code):
            self.codes[rank] = code
            self.when[rank] = time.monotonic()

        return exit_process


def _watchdogs(store, ranks, world_size, exits, heartbeat_timeout=60.0):
    dogs = {
        r: FailureWatchdog(store, r, world_size, describe_rank=lambda q: f"rank {q}", poll_interval=0.05,
                           heartbeat_timeout=heartbeat_timeout, exit_process=exits.for_rank(r))
        for r in ranks
    }
    for dog in dogs.values():
        dog.start()
    return dogs


def _wait(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_reported_failure_stops_every_other_rank_with_its_name(capfd):
    store, exits = HashStore(), _Exits()
    dogs = _watchdogs(store, [0, 1, 2], 3, exits)
    dogs[1].set_activity("training step 4")
    message = dogs[1].report_failure(RuntimeError("out of memory"))
    assert message == "rank 1 failed while training step 4: RuntimeError: out of memory"
    assert _wait(lambda: set(exits.codes) == {0, 2})
    assert exits.codes == {0: 1, 2: 1}
    assert capfd.readouterr().err.count("because rank 1 failed while training step 4") == 2
    for dog in dogs.values():
        dog.stop()


def test_the_store_host_stays_until_every_peer_has_read_the_failure():
    """Rank 0 hosts the store: leaving before a slow peer reads the record would leave that peer
    with 'the store host is gone' instead of the real failure."""
    store, exits = HashStore(), _Exits()
    dogs = _watchdogs(store, [0, 1], 3, exits)  # rank 2 is alive (beating) but has not read anything yet
    beating = threading.Event()

    def rank2_heartbeat():
        n = 0
        while not beating.is_set():
            n += 1
            store.set("megastrategy/heartbeat/2", f"{n}|busy")
            time.sleep(0.05)

    threading.Thread(target=rank2_heartbeat, daemon=True).start()
    dogs[1].report_failure(ValueError("bad batch"))
    time.sleep(1.0)
    assert 0 not in exits.codes  # still waiting for rank 2
    acked = time.monotonic()
    store.set(_ack_key(2), "1")
    assert _wait(lambda: 0 in exits.codes)
    assert exits.when[0] >= acked
    beating.set()
    for dog in dogs.values():
        dog.stop()


def test_a_silent_peer_is_named_after_the_heartbeat_timeout():
    store, exits = HashStore(), _Exits()
    dogs = _watchdogs(store, [0, 1], 3, exits, heartbeat_timeout=0.5)
    store.set("megastrategy/heartbeat/2", "1|training step 7")  # one beat, then silence (SIGKILL)
    assert _wait(lambda: {0, 1} <= set(exits.codes))
    assert "rank 2 stopped responding" in dogs[0].failure and "training step 7" in dogs[0].failure
    for dog in dogs.values():
        dog.stop()


def test_a_rank_that_finished_is_not_mistaken_for_a_dead_one():
    store, exits = HashStore(), _Exits()
    dogs = _watchdogs(store, [0, 1], 2, exits, heartbeat_timeout=0.3)
    dogs[1].stop()  # normal end: its heartbeat says "done"
    time.sleep(1.0)
    assert exits.codes == {}
    dogs[0].stop()


def test_a_failed_earlier_fit_does_not_stop_the_next_one():
    """A fit whose setup error the user caught leaves its record; the next fit's watchdogs (a new
    namespace, as megastrategy.runtime.watchdog numbers the fits) must not read it."""
    store, exits = HashStore(), _Exits()
    FailureWatchdog(store, 1, 2, describe_rank=lambda q: f"rank {q}", namespace="ms/fit0",
                    exit_process=exits.for_rank(1)).report_failure(ValueError("refused plan"))
    dog = FailureWatchdog(store, 0, 2, describe_rank=lambda q: f"rank {q}", poll_interval=0.05,
                          namespace="ms/fit1", exit_process=exits.for_rank(0))
    dog.start()
    time.sleep(0.5)
    assert exits.codes == {} and dog.failure is None
    dog.stop()


def test_a_setup_error_every_rank_raises_reaches_every_rank_instead_of_ending_it():
    """The block check refuses a plan on every rank, a little apart: the slower rank raises its own
    (catchable) error within the grace instead of being ended by the faster one's record."""
    store, exits = HashStore(), _Exits()
    dogs = _starting_pair(store, exits, grace=2.0)
    dogs[1].report_failure(MegatronConfigErrorLike("refused plan"))
    time.sleep(0.5)
    dogs[0].report_failure(MegatronConfigErrorLike("refused plan"))
    time.sleep(0.3)
    assert exits.codes == {}
    for dog in dogs.values():
        dog.stop()


def test_a_rank_that_does_not_raise_in_setup_is_ended_after_the_grace():
    store, exits = HashStore(), _Exits()
    dogs = _starting_pair(store, exits, grace=0.5)
    dogs[1].report_failure(RuntimeError("only here"))
    assert _wait(lambda: 0 in exits.codes)
    for dog in dogs.values():
        dog.stop()


class MegatronConfigErrorLike(Exception):
    pass


def _starting_pair(store, exits, grace: float) -> dict:
    """Two ranks still in setup (activity ``starting``), started."""
    dogs = {r: FailureWatchdog(store, r, 2, describe_rank=lambda q: f"rank {q}", poll_interval=0.05,
                               setup_grace=grace, exit_process=exits.for_rank(r)) for r in (0, 1)}
    for dog in dogs.values():
        dog.start()
    return dogs
