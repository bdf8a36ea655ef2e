"""The multi-host heartbeat watchdog (`training.distributed.PeerWatchdog.watch`) against
an in-memory key-value store shaped like JAX's distributed client, with short
intervals: a peer is judged only from its first beat on, a silent peer is found
within the timeout, an unreachable store is reported."""

import threading
import time

from training.distributed import PeerWatchdog

INTERVAL, TIMEOUT = 0.02, 0.3


class Store:
    """key_value_set / key_value_try_get like jax's DistributedRuntimeClient."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()
        self.down = False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: connection refused")
        with self.lock:
            self.values[key] = value

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]


def watch_in_thread(store, me, n):
    """Process `me`'s watchdog on a thread; returns (watchdog, thread, reasons it reported)."""
    lost: list[str] = []
    dog = PeerWatchdog(TIMEOUT, INTERVAL, on_lost=lost.append)
    thread = threading.Thread(target=dog.watch, args=(store, me, n), daemon=True)
    thread.start()
    return dog, thread, lost


def stop(*dogs_and_threads):
    for dog, thread, _ in dogs_and_threads:
        dog._stop.set()
        thread.join(5)


def test_the_first_beat_is_written_at_once():
    store = Store()
    run = watch_in_thread(store, 1, 2)
    time.sleep(INTERVAL / 4)
    assert store.values.get("attention_jax/alive/1") == "1"
    stop(run)


def test_a_peer_still_getting_ready_is_waited_for_beyond_the_timeout():
    # Process 1 starts beating 3 timeouts after process 0 (a slower host tokenizing
    # or compiling): it is not gone, and beating together nobody is reported.
    store = Store()
    first = watch_in_thread(store, 0, 2)
    time.sleep(3 * TIMEOUT)
    second = watch_in_thread(store, 1, 2)
    time.sleep(3 * TIMEOUT)
    assert first[1].is_alive() and second[1].is_alive()
    assert first[2] == [] and second[2] == []
    stop(first, second)


def test_a_peer_that_stops_beating_is_reported_within_the_timeout():
    store = Store()
    first, second = watch_in_thread(store, 0, 3), watch_in_thread(store, 2, 3)
    late = watch_in_thread(store, 1, 3)
    time.sleep(2 * INTERVAL)
    stop(late)  # process 1 is killed: its counter stops
    killed_at = time.monotonic()
    first[1].join(5)
    waited = time.monotonic() - killed_at
    assert first[2] == [f"process 1 sent no heartbeat for {TIMEOUT:.0f} s"]
    assert TIMEOUT - 2 * INTERVAL <= waited < TIMEOUT + 10 * INTERVAL, waited
    second[1].join(5)
    assert second[2] == first[2]


def test_an_unreachable_store_is_reported():
    store = Store()
    run = watch_in_thread(store, 1, 2)
    store.down = True
    run[1].join(5)
    assert not run[1].is_alive()
    (reason,) = run[2]
    assert "coordination service (process 0) is unreachable" in reason
    assert "UNAVAILABLE" in reason
