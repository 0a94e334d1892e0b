"""The batching scheduler's hooks for hosting it in the upload service (docs/semantics.md §7.2, §7.3):
batches per group, an action factory, cancel by predicate, non-blocking admission, availability
listeners, a sticky error set from outside; and the service really hosting that one scheduler."""
from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import CancelledError
from multiprocessing import Pipe

import pytest

from dstl.changelog.upload.scheduler import (AdmittedTask, BatchingStateChangeUploadScheduler,
                                             _BatchUploadAction)
from dstl.changelog.upload.throttle import UploadThrottle
from test_batching_scheduler import scheduler_parts
from test_uploader import Sink, sealed
from writer_modes import wait_until

T = 20


@pytest.fixture
def parts(tmp_path):
    yield from scheduler_parts(tmp_path, 60_000)


class _GatedAction:
    """The default one-file action, whose attempts wait for `gate` (a batch held in flight)."""

    def __init__(self, uploader, tasks, gate: threading.Event):
        self.inner = _BatchUploadAction(uploader, tasks)
        self.tasks, self.gate = tasks, gate

    def try_execute(self):
        assert self.gate.wait(T)
        return self.inner.try_execute()

    def complete_with_result(self, result):
        self.inner.complete_with_result(result)

    def discard_result(self, result):
        self.inner.discard_result(result)

    def handle_failure(self, exc):
        self.inner.handle_failure(exc)


def test_group_key_cuts_one_batch_and_one_file_per_group_per_drain(parts):
    scheduler, metrics, files, uploader = parts
    batches = []

    def make_action(tasks):
        batches.append([t.inner for t in tasks])
        return _BatchUploadAction(uploader, tasks)

    s = scheduler(make_action=make_action, group_key=lambda task: int(task.change_sets[0].log_id.int) % 2)
    sink = Sink()
    submitted = [sink.task(sealed(log, 0, [(log, b"x" * (10 + log))])) for log in range(5)]
    for t in submitted:
        s.upload(t)
    assert s.queue_size() == 5 and files() == []
    s.flush()
    wait_until(lambda: len(sink.results) == 5, T, "every task")
    # one action per group, first-come order inside each, built from the tasks as submitted
    assert batches == [[submitted[0], submitted[2], submitted[4]], [submitted[1], submitted[3]]]
    assert len(files()) == 2
    by_file = {}
    for results in sink.results:
        by_file.setdefault(results[0].stream_handle.path, []).append(int(results[0].sequence_number))
    assert sorted(len(v) for v in by_file.values()) == [2, 3]
    sizes = metrics.upload_batch_sizes.snapshot()
    assert sizes["count"] == 2 and sizes["max"] == 3
    assert s.in_flight_bytes() == 0 and s.get_availability_provider().is_available()


def test_make_action_gets_admitted_tasks_whose_settling_returns_capacity_first(parts):
    scheduler, _, _, uploader = parts
    seen = []
    s = scheduler(make_action=lambda tasks: seen.extend(tasks) or _BatchUploadAction(uploader, tasks))
    in_flight_at_callback = []

    sink = Sink()
    task = sink.task(sealed(0, 0, [(0, b"y" * 50)]))
    inner_complete = task.on_complete
    task.on_complete = lambda results: (in_flight_at_callback.append(s.in_flight_bytes()),
                                        inner_complete(results))
    s.upload(task)
    s.flush()
    wait_until(lambda: sink.results, T, "the task")
    assert len(seen) == 1 and isinstance(seen[0], AdmittedTask) and seen[0].inner is task
    assert in_flight_at_callback == [0]  # the bytes went back before the writer's callback ran


def test_cancel_fails_only_the_selected_queued_tasks(parts):
    scheduler, _, files, _ = parts
    s = scheduler(delay_ms=300)
    sink = Sink()
    keep = sink.task(sealed(1, 0, [(1, b"k" * 30)]))
    drop = [sink.task(sealed(2, i, [(2, b"d" * 20)])) for i in range(2)]
    for t in (drop[0], keep, drop[1]):
        s.upload(t)
    size = sum(t.size for t in (keep, *drop))
    assert s.in_flight_bytes() == size
    reason = CancelledError("client gone")
    assert s.cancel(lambda t: t in drop, reason) == 2
    assert [f[1] for f in sink.failures] == [reason, reason]
    assert sorted(int(f[0][0]) for f in sink.failures) == [0, 1]
    assert s.queue_size() == 1 and s.in_flight_bytes() == keep.size
    assert s.cancel(lambda t: t in drop, reason) == 0  # already gone
    wait_until(lambda: sink.results, T, "the kept task (the persist delay still runs)")
    assert len(files()) == 1 and len(sink.failures) == 2
    assert s.cancel(lambda t: True, reason) == 0  # in flight or done: not touched by cancel


def test_cancelling_every_queued_task_stops_the_timer(parts):
    scheduler, _, files, _ = parts
    drains = []
    s = scheduler(delay_ms=100, make_action=lambda tasks: drains.append(tasks))
    sink = Sink()
    s.upload(sink.task(sealed(0, 0, [(0, b"a")])))
    assert s.cancel(lambda t: True, CancelledError("x")) == 1
    s.upload(sink.task(sealed(0, 1, [(0, b"b")])))  # a fresh delay for the next task
    assert s.cancel(lambda t: True, CancelledError("x")) == 1
    threading.Event().wait(0.4)
    assert drains == [] and files() == [] and len(sink.failures) == 2 and s.in_flight_bytes() == 0


def test_upload_nowait_admits_past_the_limit_and_listeners_hear_each_change(parts):
    scheduler, _, files, uploader = parts
    gate = threading.Event()
    s = scheduler(delay_ms=0, threshold=100, max_in_flight=100,
                  make_action=lambda tasks: _GatedAction(uploader, tasks, gate))
    heard = []
    s.get_availability_provider().add_listener(heard.append)
    sink = Sink()
    s.upload_nowait(sink.task(sealed(0, 0, [(0, b"a" * 60)])))
    assert s.in_flight_bytes() == 60 and heard == []
    s.upload_nowait(sink.task(sealed(0, 1, [(0, b"b" * 60)])))  # overshoots: admitted, never waits
    s.upload_nowait(sink.task(sealed(1, 0, [(1, b"c" * 10)])))  # its caller trusted a stale availability
    assert s.in_flight_bytes() == 130 and heard == [False]
    assert not s.get_availability_provider().is_available() and s.waiting_callers == 0

    later = threading.Thread(target=s.upload, args=(sink.task(sealed(2, 0, [(2, b"d" * 5)])),), daemon=True)
    later.start()  # a blocking caller waits for capacity, as in thread mode
    wait_until(lambda: s.waiting_callers == 1, T, "the blocking caller to wait")
    gate.set()
    later.join(T)
    assert not later.is_alive()
    wait_until(lambda: len(sink.results) == 4, T, "every task")
    assert heard == [False, True] and s.in_flight_bytes() == 0 and len(files()) == 4

    s.close()
    closed = sink.task(sealed(3, 0, [(3, b"e")]))
    s.upload_nowait(closed)  # does not raise: the task fails
    assert isinstance(sink.failures[-1][1], CancelledError) and closed.finished


def test_upload_nowait_runs_the_persist_delay_from_the_hand_over(parts):
    """The service's clients copy a task into shared memory before it arrives: the persist delay
    runs from when its writer handed it over (`queued_at`), and a task whose successors are on
    their way (`more`) waits for them, at most the delay from its arrival."""
    scheduler, _, _, uploader = parts
    drains = []
    s = scheduler(delay_ms=400, make_action=lambda tasks: drains.append((time.monotonic(), len(tasks)))
                  or _BatchUploadAction(uploader, tasks))
    sink = Sink()
    # handed over a delay ago (its copy took that long): drained on arrival
    s.upload_nowait(sink.task(sealed(0, 0, [(0, b"a")])), time.monotonic() - 0.5)
    assert [n for _, n in drains] == [1] and s.queue_size() == 0
    # handed over 300 ms ago: drained 100 ms after arrival, not 400
    t0 = time.monotonic()
    s.upload_nowait(sink.task(sealed(0, 1, [(0, b"b")])), t0 - 0.3)
    wait_until(lambda: len(drains) == 2, T, "the second drain")
    assert 0.05 <= drains[1][0] - t0 < 0.3 and drains[1][1] == 1
    # a late task with more on their way waits for them; the last one (handed over long ago, as
    # the first was) drains both at once
    s.upload_nowait(sink.task(sealed(0, 2, [(0, b"c")])), time.monotonic() - 0.5, more=True)
    threading.Event().wait(0.1)
    assert len(drains) == 2 and s.queue_size() == 1
    s.upload_nowait(sink.task(sealed(0, 3, [(0, b"d")])), time.monotonic() - 0.2)
    assert len(drains) == 3 and drains[2][1] == 2 and s.queue_size() == 0
    # more on their way that never come: the delay from arrival ends the wait
    t1 = time.monotonic()
    s.upload_nowait(sink.task(sealed(0, 4, [(0, b"e")])), t1 - 0.5, more=True)
    wait_until(lambda: len(drains) == 4, T, "the fallback drain")
    assert drains[3][0] - t1 >= 0.35 and drains[3][1] == 1
    # without `queued_at` (thread mode's `upload`) the delay runs from arrival, as before
    t2 = time.monotonic()
    s.upload(sink.task(sealed(0, 5, [(0, b"f")])))
    s.upload_nowait(sink.task(sealed(0, 6, [(0, b"g")])), time.monotonic())
    wait_until(lambda: len(drains) == 5, T, "the last drain")
    assert drains[4][0] - t2 >= 0.35 and drains[4][1] == 2
    wait_until(lambda: len(sink.results) == 7, T, "every task uploaded")
    assert not sink.failures


def test_listeners_end_on_the_current_state_under_racing_changes():
    th = UploadThrottle(40)
    heard = []
    lock = threading.Lock()

    def listener(available):
        with lock:
            heard.append(available)

    th.availability.add_listener(listener)
    th.take(45)  # one taker crosses the limit alone: heard at once
    assert heard == [False]
    th.release(45)
    assert heard == [False, True]

    def worker(seed):
        rnd = random.Random(seed)
        for _ in range(300):
            n = rnd.randint(15, 30)
            th.take(n)
            time.sleep(0)  # let the other threads take theirs: the limit is crossed both ways
            th.release(n)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert th.in_flight == 0 and th.availability.is_available()
    assert heard and heard[-1] is True  # the last word is the state now
    assert all(a != b for a, b in zip(heard, heard[1:]))  # changes only, never a repeat
    th.availability.remove_listener(listener)
    th.take(60)
    assert heard[-1] is True  # removed: not called


def test_fail_later_uploads_makes_an_error_sticky(parts):
    scheduler, _, files, _ = parts
    s = scheduler()
    sink = Sink()
    s.upload(sink.task(sealed(0, 0, [(0, b"a")])))
    err = OSError("the service could not start its processes")
    s.fail_later_uploads(err)
    s.fail_later_uploads(RuntimeError("a later error does not replace it"))
    s.flush()  # the queued task fails at its drain
    s.upload_nowait(sink.task(sealed(0, 1, [(0, b"b")])))
    assert [f[1] for f in sink.failures] == [err, err] and s.sticky_error is err
    assert files() == [] and s.in_flight_bytes() == 0


def _read_until(conn, stop, timeout=T):
    got = []
    while conn.poll(timeout):
        got.append(conn.recv())
        if stop(got[-1]):
            return got
    raise AssertionError(f"no final message after {got!r}")


def test_the_service_hosts_the_shared_scheduler(tmp_path):
    """In-process service object, real pipes as its clients' connections: queue, gauges, grouping,
    back-pressure pushes and a closing client's cancellation all go through the one shared scheduler."""
    from dstl.changelog.upload.service.pool import UploaderPool, service_context
    from dstl.changelog.upload.service.protocol import Availability, Closed, Failed, Hello, Upload, Welcome
    from dstl.changelog.upload.service.runtime import ServicePaths
    from dstl.changelog.upload.service.server import UploadService
    from dstl.config import StorageConfig

    config = StorageConfig(str(tmp_path / "base"), persist_delay_ms="1 min", max_in_flight="100 b",
                           persist_size_threshold="100 b")
    svc = UploadService(ServicePaths(str(tmp_path / "rt")), config)
    # a pool that is never started: an attempt waits in it for an uploader, holding its batch in flight
    svc.pool = UploaderPool(service_context(), 1)
    try:
        assert type(svc.scheduler) is BatchingStateChangeUploadScheduler
        assert svc.scheduler.executor is svc.executor and svc.scheduler.retry_policy is svc.policy
        for own in ("queue", "queued_bytes", "in_flight", "available", "timer", "sticky"):
            assert not hasattr(svc, own), own  # no second copy of the scheduler's state
        svc._ready.set()
        a_conn, a = Pipe()
        b_conn, b = Pipe()
        ca = svc._hello(a_conn, Hello("ca", os.getpid()))
        cb = svc._hello(b_conn, Hello("cb", os.getpid()))
        for end in (a, b):
            welcome = end.recv()
            assert type(welcome) is Welcome and welcome.available and welcome.max_in_flight == 100

        svc._upload(Upload(1, "job-a", None, "seg-a1", [], 40), ca)
        svc._upload(Upload(1, "job-b", None, "seg-b1", [], 20), cb)
        assert svc.scheduler.queue_size() == 2 and svc.scheduler.in_flight_bytes() == 60
        assert svc.status()["queued"] == 2 and svc.status()["in_flight"] == 60
        assert not a.poll(0.05)

        svc._client_closing(cb)  # b's queued task fails through the scheduler's cancel; then Closed
        got = _read_until(b, lambda m: type(m) is Closed)
        assert [(type(m), m.task_id) for m in got if type(m) is Failed] == [(Failed, 1)]
        assert isinstance(got[0].error, CancelledError) and cb.tasks == {}
        assert svc.scheduler.queue_size() == 1 and svc.scheduler.in_flight_bytes() == 40

        svc._upload(Upload(2, "job-a", None, "seg-a2", [], 60), ca)  # 100: unavailable, pushed; drained
        msg = a.recv()
        assert type(msg) is Availability and msg.available is False and msg.gauges[0] == 100
        wait_until(lambda: svc.scheduler.queue_size() == 0, T, "the drain")
        assert svc.scheduler.in_flight_bytes() == 100 and sorted(ca.tasks) == [1, 2]

        svc.pool.close()  # the waiting attempt is cancelled: both tasks of a's one batch fail
        got = _read_until(a, lambda m: type(m) is Failed and m.task_id == 2)
        failed = [m for m in got if type(m) is Failed]
        assert [m.task_id for m in failed] == [1, 2]  # first come, first in the batch
        assert len({m.metrics["batch_id"] for m in failed}) == 1 and failed[0].metrics["batch"] == 2
        assert any(type(m) is Availability and m.available for m in got)
        assert svc.scheduler.in_flight_bytes() == 0 and ca.tasks == {}
    finally:
        svc.scheduler.close("test over")
        svc.pool.close()
