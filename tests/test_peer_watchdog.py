"""The multi-host heartbeat watchdog (`common.distributed.PeerWatchdog.watch`) against
an in-memory key-value store shaped like JAX's distributed client, with short
intervals: a peer is judged only from its first beat on, a silent peer is found
within the timeout (timed from its last write to the store, with slack for a loaded
CI box), an unreachable store is reported."""

import threading
import time

from attention_jax.runtime.distributed import PeerWatchdog

INTERVAL, TIMEOUT = 0.02, 0.5
SLACK = 0.5  # a thread's wake-up on a loaded 2-core box; the bound is still finite


class Store:
    """key_value_set / key_value_try_get like jax's DistributedRuntimeClient."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.written: dict[str, float] = {}  # key -> when it was last set (monotonic)
        self.lock = threading.Lock()
        self.down = False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: connection refused")
        with self.lock:
            self.values[key] = value
            self.written[key] = time.monotonic()

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]


def watch_in_thread(store, me, n, interval=INTERVAL):
    """Process `me`'s watchdog on a thread; returns (watchdog, thread, (reason, when) reported)."""
    lost: list[tuple[str, float]] = []
    dog = PeerWatchdog(TIMEOUT, interval, on_lost=lambda why: lost.append((why, time.monotonic())))
    thread = threading.Thread(target=dog.watch, args=(store, me, n), daemon=True)
    thread.start()
    return dog, thread, lost


def stop(*dogs_and_threads):
    for dog, thread, _ in dogs_and_threads:
        dog.__exit__(None, None, None)  # as leaving the `with` block does
        thread.join(5)


def test_the_first_beat_is_written_at_once():
    store = Store()
    run = watch_in_thread(store, 1, 2, interval=600.0)  # not after the first interval
    deadline = time.monotonic() + 10
    while "attention_jax/alive/1" not in store.values and time.monotonic() < deadline:
        time.sleep(0.01)
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
    time.sleep(4 * INTERVAL)
    stop(late)  # process 1 is killed: its counter stops
    last_beat = store.written["attention_jax/alive/1"]
    for run in first, second:
        run[1].join(TIMEOUT + 5)
        ((reason, when),) = run[2]
        assert reason == f"process 1 sent no heartbeat for {TIMEOUT:.0f} s"
        # Never before the timeout has passed since the last beat; within it + 2 beats.
        assert TIMEOUT <= when - last_beat < TIMEOUT + 2 * INTERVAL + SLACK, when - last_beat


def test_an_unreachable_store_is_reported():
    store = Store()
    run = watch_in_thread(store, 1, 2)
    store.down = True
    run[1].join(5)
    assert not run[1].is_alive()
    ((reason, _),) = run[2]
    assert "coordination service (process 0) is unreachable" in reason
    assert "UNAVAILABLE" in reason
