"""RetryPolicy and RetryingExecutor (SEMANTICS §8) with real threads and scripted in-memory actions."""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from dstl.config import StorageConfig
from dstl.metrics import Histogram
from dstl.changelog.upload.retry import AttemptTimeoutError, FixedRetryPolicy, RetryingExecutor, RetryPolicy

WAIT = 10  # generous upper bound for anything that should happen "soon"


# --- scripted actions ---------------------------------------------------------------------------
def ok(value=None):
    return lambda n: n if value is None else value


def fail(exc_type=OSError):
    def run(n):
        raise exc_type(f"attempt {n} failed")
    return run


def wait_for(event, then):
    def run(n):
        assert event.wait(WAIT), "test event never set"
        return then(n)
    return run


class FakeAction:
    """Attempt n runs `behaviours[n-1]` (the last one repeats); records every callback."""

    def __init__(self, *behaviours):
        self.behaviours = behaviours
        self.lock = threading.Lock()
        self.started = []      # attempt numbers, in start order
        self.start_times = {}
        self.completed = []
        self.discarded = []
        self.failures = []
        self.settled = threading.Event()
        self.discard_seen = threading.Condition(self.lock)

    def try_execute(self):
        with self.lock:
            n = len(self.started) + 1
            self.started.append(n)
            self.start_times[n] = time.monotonic()
        return self.behaviours[min(n, len(self.behaviours)) - 1](n)

    def complete_with_result(self, result):
        with self.lock:
            self.completed.append(result)
        self.settled.set()

    def discard_result(self, result):
        with self.lock:
            self.discarded.append(result)
            self.discard_seen.notify_all()

    def handle_failure(self, exc):
        with self.lock:
            self.failures.append(exc)
        self.settled.set()

    def wait_settled(self):
        assert self.settled.wait(WAIT), "action never settled"

    def wait_discards(self, n):
        with self.lock:
            assert self.discard_seen.wait_for(lambda: len(self.discarded) >= n, WAIT)

    def wait_started(self, n):
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.started) >= n:
                    return
            time.sleep(0.002)
        raise AssertionError(f"only {self.started} started")


@pytest.fixture
def hists():
    return Histogram(), Histogram()


@pytest.fixture
def executor(hists):
    ex = RetryingExecutor(4, *hists)
    yield ex
    ex.close()


# --- policy -------------------------------------------------------------------------------------
def test_fixed_policy_decisions():
    p = RetryPolicy.fixed(3, 1000, 500)
    assert p.timeout_ms == 1000
    assert p.retry_after(1, AttemptTimeoutError()) == 0
    assert p.retry_after(1, TimeoutError()) == 0          # TimeoutError is an OSError: timeout first
    assert p.retry_after(2, OSError()) == 500
    assert p.retry_after(1, ConnectionResetError()) == 500
    assert p.retry_after(1, FileNotFoundError()) == 500
    assert p.retry_after(1, ValueError()) == -1
    assert p.retry_after(1, CancelledError()) == -1
    assert p.retry_after(3, OSError()) == -1 and p.retry_after(3, TimeoutError()) == -1
    assert RetryPolicy.fixed(1, 0, 0).retry_after(1, OSError()) == -1


def test_none_policy_and_from_config():
    n = RetryPolicy.none()
    assert n.timeout_ms <= 0 and n.retry_after(1, OSError()) == -1 and n.retry_after(1, TimeoutError()) == -1
    cfg = StorageConfig("/x", upload_timeout_ms="2 s", max_attempts=4, next_attempt_delay_ms=7)
    p = RetryPolicy.from_config(cfg)
    assert isinstance(p, FixedRetryPolicy)
    assert (p.max_attempts, p.timeout_ms, p.delay_ms) == (4, 2000, 7)
    assert RetryPolicy.from_config({"dstl.dfs.base-path": "/x", "dstl.dfs.upload.retry-policy": "none"}) is n
    for bad in ((0, 1, 1), (1, 1, -1), (True, 1, 1), (1, 1.5, 1)):
        with pytest.raises(ValueError):
            RetryPolicy.fixed(*bad)


# --- executor: outcomes -------------------------------------------------------------------------
def test_first_attempt_succeeds(executor, hists):
    a = FakeAction(ok("r"))
    executor.execute(RetryPolicy.fixed(3, 1000, 10), a)
    a.wait_settled()
    assert a.completed == ["r"] and a.failures == [] and a.started == [1]
    assert hists[0].values() == [1] and hists[1].values() == [1]


def test_a_finished_action_is_not_kept_alive_until_its_attempt_timeout(executor):
    """The attempt's timeout timer is cancelled when the attempt ends; the timer heap must then drop
    the action (in thread mode it holds the uploaded bodies: megabytes per batch, for upload.timeout)."""
    import gc
    import weakref

    a = FakeAction(ok("r"))
    gone = weakref.ref(a)
    executor.execute(RetryPolicy.fixed(3, 60_000, 10), a)
    a.wait_settled()
    del a
    deadline = time.monotonic() + WAIT
    while gone() is not None and time.monotonic() < deadline:  # the worker thread lets go of it
        gc.collect()
        time.sleep(0.01)
    assert gone() is None


def test_io_failures_are_retried_after_the_delay(executor, hists):
    a = FakeAction(fail(), fail(), ok("third"))
    executor.execute(RetryPolicy.fixed(3, 0, 80), a)
    a.wait_settled()
    assert a.completed == ["third"] and a.started == [1, 2, 3]
    assert a.start_times[2] - a.start_times[1] >= 0.075
    assert a.start_times[3] - a.start_times[2] >= 0.075
    assert hists[0].snapshot()["min"] == hists[0].snapshot()["max"] == 3  # OPTIONS §4 check 3
    assert hists[1].values() == [3]


def test_gives_up_after_max_attempts(executor, hists):
    a = FakeAction(fail())
    executor.execute(RetryPolicy.fixed(3, 0, 0), a)
    a.wait_settled()
    time.sleep(0.05)
    assert a.started == [1, 2, 3] and a.completed == []
    assert len(a.failures) == 1 and "attempt 3" in str(a.failures[0]) and isinstance(a.failures[0], OSError)
    assert hists[0].count == 0 and hists[1].count == 0  # only successful actions are recorded


def test_non_io_errors_are_not_retried(executor):
    a = FakeAction(fail(ValueError), ok())
    executor.execute(RetryPolicy.fixed(5, 0, 0), a)
    a.wait_settled()
    time.sleep(0.05)
    assert a.started == [1] and isinstance(a.failures[0], ValueError)


def test_none_policy_fails_at_once(executor):
    a = FakeAction(fail(), ok())
    executor.execute(RetryPolicy.none(), a)
    a.wait_settled()
    time.sleep(0.05)
    assert a.started == [1] and isinstance(a.failures[0], OSError)


def test_base_exceptions_still_settle_the_action(executor):
    class Boom(BaseException):
        pass

    a = FakeAction(fail(Boom))
    executor.execute(RetryPolicy.fixed(3, 0, 0), a)
    a.wait_settled()
    assert a.started == [1] and isinstance(a.failures[0], Boom)


def test_timeout_error_from_the_action_retries_immediately(executor):
    a = FakeAction(fail(TimeoutError), ok())
    t0 = time.monotonic()
    executor.execute(RetryPolicy.fixed(3, 0, 5000), a)  # a 5 s I/O delay would be obvious
    a.wait_settled()
    assert a.completed == [2] and time.monotonic() - t0 < 2.0


# --- executor: speculative attempts -------------------------------------------------------------
def test_slow_attempt_gets_a_parallel_successor_and_loser_is_discarded(executor, hists):
    release1 = threading.Event()
    a = FakeAction(wait_for(release1, ok("slow")), ok("fast"))
    executor.execute(RetryPolicy.fixed(3, 60, 5000), a)
    a.wait_settled()
    assert a.completed == ["fast"] and a.started == [1, 2]
    assert a.start_times[2] - a.start_times[1] >= 0.055  # started by the timeout, not the delay
    release1.set()
    a.wait_discards(1)
    assert a.discarded == ["slow"] and a.failures == []
    assert hists[0].values() == [2] and hists[1].values() == [2]


def test_first_success_wins_even_if_it_is_the_timed_out_attempt(executor, hists):
    go1, release2 = threading.Event(), threading.Event()
    a = FakeAction(wait_for(go1, ok("first")), wait_for(release2, ok("second")))
    executor.execute(RetryPolicy.fixed(3, 300, 0), a)
    a.wait_started(2)  # attempt 1 timed out; attempt 2 has 300 ms before its own timeout
    go1.set()
    a.wait_settled()
    assert a.completed == ["first"]
    release2.set()
    a.wait_discards(1)
    assert a.discarded == ["second"] and a.started == [1, 2]
    assert hists[0].values() == [1] and hists[1].values() == [2]


def test_timeout_of_last_attempt_fails_even_if_it_succeeds_later(executor):
    release = threading.Event()
    a = FakeAction(wait_for(release, ok("late")))
    executor.execute(RetryPolicy.fixed(1, 50, 0), a)
    a.wait_settled()
    assert a.completed == [] and isinstance(a.failures[0], AttemptTimeoutError)
    assert isinstance(a.failures[0], TimeoutError)
    release.set()
    a.wait_discards(1)
    assert a.discarded == ["late"] and a.completed == []


def test_timed_out_attempt_that_later_raises_starts_nothing(executor):
    fail1, release2 = threading.Event(), threading.Event()

    def first(n):
        assert fail1.wait(WAIT)
        raise OSError("late failure of attempt 1")

    a = FakeAction(first, wait_for(release2, ok("second")), ok("third"))
    executor.execute(RetryPolicy.fixed(3, 300, 0), a)
    a.wait_started(2)
    fail1.set()
    time.sleep(0.1)
    release2.set()
    a.wait_settled()
    assert a.completed == ["second"] and a.started == [1, 2]  # no third attempt


def test_all_speculative_attempts_time_out(executor, hists):
    release = threading.Event()
    a = FakeAction(wait_for(release, ok()))
    executor.execute(RetryPolicy.fixed(3, 40, 0), a)
    a.wait_settled()
    assert a.started == [1, 2, 3] and isinstance(a.failures[0], AttemptTimeoutError)
    assert "attempt 3" in str(a.failures[0])
    release.set()
    a.wait_discards(3)
    assert sorted(a.discarded) == [1, 2, 3] and a.completed == []
    assert hists[0].count == 0


def test_io_failure_and_timeout_mixed(executor, hists):
    release1 = threading.Event()
    # 1 hangs (times out) -> 2 starts and fails with OSError -> 3 after the delay succeeds
    a = FakeAction(wait_for(release1, ok("one")), fail(), ok("three"))
    executor.execute(RetryPolicy.fixed(3, 50, 30), a)
    a.wait_settled()
    assert a.completed == ["three"] and a.started == [1, 2, 3]
    release1.set()
    a.wait_discards(1)
    assert a.discarded == ["one"]
    assert hists[0].values() == [3] and hists[1].values() == [3]


# --- close --------------------------------------------------------------------------------------
def test_execute_after_close_raises():
    ex = RetryingExecutor(1)
    ex.close()
    assert ex.closed
    with pytest.raises(RuntimeError, match="closed"):
        ex.execute(RetryPolicy.none(), FakeAction(ok()))
    ex.close()  # idempotent


def test_close_cancels_a_delayed_retry():
    ex = RetryingExecutor(2)
    a = FakeAction(fail(), ok())
    ex.execute(RetryPolicy.fixed(3, 0, 10_000), a)
    a.wait_started(1)
    time.sleep(0.05)  # attempt 1 has failed; attempt 2 waits 10 s
    t0 = time.monotonic()
    ex.close()
    assert time.monotonic() - t0 < 2.0
    a.wait_settled()
    assert a.started == [1] and a.completed == [] and isinstance(a.failures[0], CancelledError)


def test_close_waits_for_running_attempts_which_still_complete():
    ex = RetryingExecutor(2)
    release = threading.Event()
    a = FakeAction(wait_for(release, ok("done")))
    ex.execute(RetryPolicy.fixed(3, 0, 0), a)
    a.wait_started(1)
    closer = threading.Thread(target=ex.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # close(wait=True) waits for the running attempt
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert a.completed == ["done"]


def test_running_attempt_failing_after_close_is_not_retried():
    ex = RetryingExecutor(1)
    release = threading.Event()
    a = FakeAction(wait_for(release, fail()), ok())
    ex.execute(RetryPolicy.fixed(3, 0, 0), a)
    a.wait_started(1)
    ex.close(wait=False)
    release.set()
    a.wait_settled()
    ex.close()
    assert a.started == [1] and isinstance(a.failures[0], OSError)


def test_attempts_queued_behind_busy_workers_are_cancelled_at_close():
    ex = RetryingExecutor(1)
    release = threading.Event()
    busy = FakeAction(wait_for(release, ok("busy")))
    queued = FakeAction(ok("queued"))
    ex.execute(RetryPolicy.none(), busy)
    busy.wait_started(1)
    ex.execute(RetryPolicy.none(), queued)
    ex.close(wait=False)
    release.set()
    ex.close()
    busy.wait_settled()
    queued.wait_settled()
    assert busy.completed == ["busy"]
    assert queued.started == [] and isinstance(queued.failures[0], CancelledError)


def test_speculative_successor_after_close_is_not_started():
    ex = RetryingExecutor(2)
    release = threading.Event()
    a = FakeAction(wait_for(release, ok("late")))
    ex.execute(RetryPolicy.fixed(3, 100, 0), a)
    a.wait_started(1)
    ex.close(wait=False)
    a.wait_settled()  # the timeout fires after close: no successor, the action fails
    assert a.started == [1] and isinstance(a.failures[0], TimeoutError)
    release.set()
    ex.close()
    assert a.discarded == ["late"]


# --- robustness ---------------------------------------------------------------------------------
def test_callback_exceptions_do_not_break_the_executor(executor, caplog):
    class Grumpy(FakeAction):
        def complete_with_result(self, result):
            super().complete_with_result(result)
            raise RuntimeError("callback bug")

    g = Grumpy(ok())
    executor.execute(RetryPolicy.none(), g)
    g.wait_settled()
    a = FakeAction(ok("still works"))
    executor.execute(RetryPolicy.none(), a)
    a.wait_settled()
    assert a.completed == ["still works"]


def test_many_actions_each_settle_exactly_once(hists):
    import random

    rng = random.Random(7)
    ex = RetryingExecutor(4, *hists)
    actions = []
    for i in range(60):
        script = [rng.choice([ok(), fail(), fail(ValueError), lambda n: (time.sleep(0.03), n)[1]])
                  for _ in range(3)]
        a = FakeAction(*script)
        actions.append(a)
        ex.execute(RetryPolicy.fixed(3, 20, 5), a)
    for a in actions:
        a.wait_settled()
    ex.close()
    for a in actions:
        assert len(a.completed) + len(a.failures) == 1
        assert len(a.completed) + len(a.discarded) <= len(a.started)
        if a.completed:
            assert a.completed[0] not in a.discarded
    successes = sum(len(a.completed) for a in actions)
    assert hists[0].count == successes == hists[1].count
    assert all(1 <= v <= 3 for v in hists[0].values())


def test_invalid_thread_count():
    with pytest.raises(ValueError):
        RetryingExecutor(0)


def test_close_from_inside_a_callback_does_not_deadlock():
    ex = RetryingExecutor(2)
    closed = threading.Event()

    class Closer(FakeAction):
        def complete_with_result(self, result):
            ex.close()  # wait=True from a worker thread must not wait for itself
            closed.set()
            super().complete_with_result(result)

    a = Closer(ok("x"))
    ex.execute(RetryPolicy.none(), a)
    assert closed.wait(WAIT)
    a.wait_settled()
    ex.close()
    assert ex.closed and a.completed == ["x"]


def test_close_from_a_timeout_failure_callback_does_not_deadlock():
    ex = RetryingExecutor(1)
    release = threading.Event()
    closed = threading.Event()

    class Closer(FakeAction):
        def handle_failure(self, exc):
            ex.close()  # runs on the timer thread
            closed.set()
            super().handle_failure(exc)

    a = Closer(wait_for(release, ok()))
    ex.execute(RetryPolicy.fixed(1, 30, 0), a)
    assert closed.wait(WAIT)
    release.set()
    ex.close()
    assert isinstance(a.failures[0], AttemptTimeoutError) and a.discarded == [1]
