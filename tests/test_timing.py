"""decode.py --stats (search/timing.py): the breakdown's fields add up.

A job is played with sleeps in place of the work: start-up, a program compiled on a
background thread while the main thread waits for it, searches on the "device" (a
thread that makes their outputs ready later), and host work between them. The
breakdown must give back those durations and keep its identities: busy + idle =
work, shares <= 1, critical path <= the wall time of programs <= their sum.
"""

import threading
import time

import pytest

from attention_jax.search import timing


class _Later:
    """An output that becomes ready `seconds` after it is made (a search in flight);
    `took` is how long it really took (a loaded machine fires the timer late)."""

    def __init__(self, seconds: float):
        self.ready = threading.Event()
        self.made, self.took = time.perf_counter(), None
        threading.Timer(seconds, self._set).start()

    def _set(self):
        self.took = time.perf_counter() - self.made
        self.ready.set()

    def block_until_ready(self):
        self.ready.wait()
        return self


@pytest.fixture
def fresh(monkeypatch):
    state = timing._State()
    state.listening = True  # no JAX listeners: this test makes its own events
    monkeypatch.setattr(timing, "_state", state)
    monkeypatch.setattr("jax.block_until_ready", lambda x: x.block_until_ready())
    timing.enable()
    yield state
    state.queue.put(None)


def test_the_breakdown_adds_up(fresh):
    time.sleep(0.10)  # start-up
    timing.mark("started")
    started = time.perf_counter() - fresh.origin

    compiled = []  # how long the "compile" really took

    def compile_in_background():
        with timing.phase("programs"):
            t0 = time.perf_counter()
            time.sleep(0.30)
            compiled.append(time.perf_counter() - t0)
        for name in ("jit(_search)", "jit(convert_element_type)", "jit(_search)"):
            timing._on_duration(timing._COMPILE_EVENTS[-1], 0.0, fun_name=name)

    worker = threading.Thread(target=compile_in_background)
    worker.start()
    with timing.phase("programs_wait"):  # the main thread waits for the program
        worker.join()
    searches = []
    for _ in range(3):
        with timing.search_call() as call:
            time.sleep(0.05)  # the call: loading its program (not device time) ...
            timing.running()  # ... then it runs
            searches.append(_Later(0.10))
            call.dispatched(searches[-1])
        with timing.phase("fetch"):
            time.sleep(0.12)  # waiting for the result
        with timing.phase("tokenize"):
            time.sleep(0.05)  # host work while the device idles
    b = timing.breakdown(lines=10, tokens=500)

    assert b["startup_s"] == pytest.approx(started, abs=2e-3)
    # (each field rounded to the millisecond)
    assert b["work_s"] == pytest.approx(b["wall_s"] - b["startup_s"], abs=2e-3)
    assert b["device_busy_s"] + b["device_idle_s"] == pytest.approx(b["work_s"], abs=2e-3)
    # 3 searches of 0.1 s and a compile of 0.3 s, as long as they really took
    assert b["device_busy_s"] == pytest.approx(sum(x.took for x in searches), abs=0.02)
    assert b["programs_s"] == pytest.approx(compiled[0], abs=0.02)
    assert b["programs_wall_s"] == pytest.approx(compiled[0], abs=0.02)
    assert b["programs_critical_s"] == pytest.approx(compiled[0], abs=0.05)
    # (the wall time of programs is at most their sum; the main thread's wait for one may
    # outlast it by a scheduling delay, so the critical path is bounded by the work only)
    assert b["programs_wall_s"] <= b["programs_s"] + 1e-3
    assert b["programs_critical_s"] <= b["work_s"]
    # idle, with no program compiling: the loads inside the calls, tokenizing, the fetches'
    # ends after the searches
    assert 0 <= b["host_bound_s"] <= b["device_idle_s"] + 1e-6
    assert 0 <= b["host_share"] <= 1
    assert b["host_share"] == pytest.approx(b["host_bound_s"] / b["work_s"], abs=1e-3)
    assert b["target_tokens_per_s"] == pytest.approx(500 / b["work_s"], rel=1e-3)
    after = b["work_s"] - b["programs_critical_s"]
    assert b["target_tokens_per_s_after_programs"] == pytest.approx(500 / after, rel=1e-2)
    assert b["searches"] == 3
    assert set(b["phases_s"]) == {"fetch", "programs_wait", "tokenize"}
    assert b["program_names"] == {"jit(_search)": 2, "jit(convert_element_type)": 1}
    assert b["programs"]["compiled"] == sum(b["program_names"].values())


def test_programs_on_other_threads_never_make_a_share_above_one(fresh):
    timing.mark("started")

    def compile_in_background():
        with timing.phase("programs"):
            time.sleep(0.2)

    workers = [threading.Thread(target=compile_in_background) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()  # not a programs_wait: e.g. compiling ahead while the device works
    b = timing.breakdown(lines=1, tokens=5)
    assert b["programs_s"] == pytest.approx(0.8, abs=0.1)  # summed over the 4 threads
    assert (
        b["programs_wall_s"] == pytest.approx(0.2, abs=0.05) and b["programs_wall_s"] <= b["work_s"]
    )
    assert b["programs_critical_s"] == 0
    assert 0 <= b["host_share"] <= 1
    assert b["target_tokens_per_s_after_programs"] == pytest.approx(5 / b["work_s"], rel=1e-2)


class _Clock:
    """A clock that moves only when told: a rate's threshold is tested exactly, however
    loaded the machine is."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


@pytest.mark.parametrize(
    ("other_s", "rate"),
    [(0.0, None), (0.0009, None), (0.002, 5 / 0.002), (0.05, 5 / 0.05)],
)
def test_no_rate_after_programs_when_they_took_all_the_time(fresh, monkeypatch, other_s, rate):
    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    fresh.origin = clock.now
    timing.mark("started")
    with timing.phase("programs"):  # on the main thread: on the critical path
        clock.now += 0.1
    clock.now += other_s  # the rest of the job: under 1% of it leaves no rate
    b = timing.breakdown(lines=1, tokens=5)
    assert b["programs_critical_s"] == pytest.approx(0.1)
    assert b["work_s"] == pytest.approx(0.1 + other_s, abs=1e-3)  # rounded to ms
    if rate is None:
        assert b["target_tokens_per_s_after_programs"] is None
    else:
        assert b["target_tokens_per_s_after_programs"] == pytest.approx(rate, rel=1e-3)
    assert b["target_tokens_per_s"] == pytest.approx(5 / (0.1 + other_s), rel=1e-3)
