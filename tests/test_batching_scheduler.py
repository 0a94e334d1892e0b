"""BatchingStateChangeUploadScheduler (docs/semantics.md §7.2, §7.3) over the real uploader and executor."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import CancelledError

import pytest

from dstl.metrics import ChangelogStorageMetricGroup
from dstl.changelog.registry import TaskChangelogRegistry
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
from dstl.changelog.upload.retry import RetryingExecutor, RetryPolicy
from dstl.changelog.upload.scheduler import BatchingStateChangeUploadScheduler, StateChangeUploadScheduler
from dstl.changelog.upload.uploader import StateChangeFsUploader
from test_uploader import JOB, Sink, sealed
from writer_modes import read_all, wait_until

T = 20


def scheduler_parts(tmp_path, default_delay_ms: int):
    """(scheduler factory, metrics, files(), uploader) over one local uploader; closes what it made."""
    registry = TaskChangelogRegistry()
    metrics = ChangelogStorageMetricGroup()
    uploader = StateChangeFsUploader(str(tmp_path), JOB, None, 1 << 16, registry, metrics)
    made = []

    def scheduler(delay_ms=default_delay_ms, threshold=1 << 20, max_in_flight=1 << 24, policy=None, executor=None,
                  **hooks):
        ex = executor or RetryingExecutor(2, metrics.attempts_per_upload, metrics.total_attempts_per_upload)
        s = BatchingStateChangeUploadScheduler(delay_ms, threshold, max_in_flight, policy or RetryPolicy.none(),
                                               uploader, ex, metrics, **hooks)
        made.append(s)
        return s

    def files():
        d = tmp_path / JOB / "dstl"
        return sorted(os.listdir(d)) if d.exists() else []

    yield scheduler, metrics, files, uploader
    for s in made:
        s.close()
    registry.close()


@pytest.fixture
def parts(tmp_path):
    made = scheduler_parts(tmp_path, 10)
    yield next(made)[:3]
    next(made, None)  # closes the schedulers and the registry


def test_writers_of_one_storage_share_one_file_with_their_own_offsets(tmp_path):
    with open_storage(str(tmp_path), upload_mode="thread", batch_persist_delay="300 ms") as s:
        writers = [s.create_writer(f"op{i}", KeyGroupRange(i * 10, i * 10 + 9)) for i in range(3)]
        futures = []
        for i, w in enumerate(writers):
            w.append_meta(b"meta-%d" % i)
            w.append(i * 10 + 1, b"v" * (i + 1))
            futures.append(w.persist(0, 1))
        handles = [f.result(T).job_manager_owned_snapshot for f in futures]
        paths = {h.handles_and_offsets[0][0].path for h in handles}
        assert len(paths) == 1  # one file
        offsets = [h.handles_and_offsets[0][1] for h in handles]
        assert offsets[0] == 0 and len(set(offsets)) == 3
        for i, h in enumerate(handles):
            assert read_all(s, h) == [(-1, b"meta-%d" % i), (i * 10 + 1, b"v" * (i + 1))]
        batch = s.metrics["ChangelogStorage.uploadBatchSizes"]
        assert batch["count"] == 1 and batch["max"] == 3


def test_size_threshold_drains_at_once(parts):
    scheduler, metrics, files = parts
    s = scheduler(delay_ms=60_000, threshold=100)
    sink = Sink()
    s.upload(sink.task(sealed(0, 0, [(0, b"a" * 60)])))
    assert s.queue_size() == 1
    s.upload(sink.task(sealed(1, 0, [(0, b"b" * 40)])))  # 100 bytes queued: drain now, no timer wait
    wait_until(lambda: len(sink.results) == 2, T, "both tasks")
    assert s.queue_size() == 0 and len(files()) == 1
    assert metrics.upload_batch_sizes.snapshot()["max"] == 2


def test_zero_delay_uploads_each_task_at_once(parts):
    scheduler, metrics, files = parts
    s = scheduler(delay_ms=0)
    sink = Sink()
    for i in range(3):
        s.upload(sink.task(sealed(i, 0, [(0, b"x")])))
        wait_until(lambda: len(sink.results) == i + 1, T, f"task {i}")
    assert len(files()) == 3
    snap = metrics.upload_batch_sizes.snapshot()
    assert snap["count"] == 3 and snap["min"] == snap["max"] == 1


def test_delay_runs_from_the_first_task_and_is_not_extended(parts):
    scheduler, _, files = parts
    s = scheduler(delay_ms=1500)
    sink = Sink()
    done_at = {}
    t0 = time.monotonic()
    s.upload(UploadTaskAt(sink, sealed(0, 0, [(0, b"a")]), done_at, "a"))
    time.sleep(0.5)
    t_b = time.monotonic()
    s.upload(UploadTaskAt(sink, sealed(1, 0, [(0, b"b")]), done_at, "b"))
    wait_until(lambda: len(done_at) == 2, T, "both tasks")
    assert done_at["a"] - t0 >= 1.5  # waited for the delay
    assert done_at["b"] - t_b < 1.4  # would be >= 1.5 if the second task had restarted the delay
    assert len(files()) == 1


def UploadTaskAt(sink, change_set, done_at, label):
    from dstl.changelog.upload.task import UploadTask

    def ok(results):
        done_at[label] = time.monotonic()
        sink.results.append(results)

    return UploadTask([change_set], ok, lambda sqns, e: sink.failures.append((sqns, e)))


def test_close_fails_queued_and_later_uploads_with_cancelled_error(parts):
    scheduler, _, files = parts
    s = scheduler(delay_ms=60_000)
    sink = Sink()
    s.upload(sink.task(sealed(0, 0, [(0, b"a")])))
    s.close()
    assert len(sink.failures) == 1 and isinstance(sink.failures[0][1], CancelledError)
    s.upload(sink.task(sealed(0, 1, [(0, b"b")])))
    assert len(sink.failures) == 2 and isinstance(sink.failures[1][1], CancelledError)
    assert files() == [] and s.in_flight_bytes() == 0
    s.close()  # idempotent


def test_writer_persist_fails_when_the_storage_closes_first(tmp_path):
    s = open_storage(str(tmp_path), upload_mode="thread", batch_persist_delay="60 s")
    w = s.create_writer("op", KeyGroupRange(0, 0))
    w.append(0, b"a")
    f = w.persist(0, 1)
    s.close()
    exc = f.exception(T)
    assert isinstance(exc, OSError) and isinstance(exc.__cause__, CancelledError)


def test_non_io_hand_off_error_becomes_sticky(parts):
    scheduler, _, files = parts
    executor = RetryingExecutor(1)
    executor.close()
    s = scheduler(delay_ms=0, executor=executor)
    sink = Sink()
    s.upload(sink.task(sealed(0, 0, [(0, b"a")])))
    assert isinstance(sink.failures[0][1], RuntimeError)
    assert s.sticky_error is sink.failures[0][1]
    s.upload(sink.task(sealed(0, 1, [(0, b"b")])))
    assert sink.failures[1][1] is s.sticky_error
    assert s.in_flight_bytes() == 0 and files() == []


class _FlakyHandOff:
    """An executor whose first hand-off raises OSError, then delegates to a real one."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def execute(self, policy, action):
        self.calls += 1
        if self.calls == 1:
            raise OSError("hand-off failed")
        self.real.execute(policy, action)

    def close(self, wait=True):
        self.real.close(wait)


def test_io_hand_off_error_is_not_sticky(parts):
    scheduler, _, files = parts
    s = scheduler(delay_ms=0, executor=_FlakyHandOff(RetryingExecutor(1)))
    sink = Sink()
    s.upload(sink.task(sealed(0, 0, [(0, b"a")])))
    assert isinstance(sink.failures[0][1], OSError) and s.sticky_error is None
    s.upload(sink.task(sealed(0, 1, [(0, b"b")])))
    wait_until(lambda: len(sink.results) == 1, T, "second task")
    assert len(files()) == 1


def test_threshold_above_max_in_flight_is_rejected(parts):
    scheduler, _, _ = parts
    with pytest.raises(ValueError, match="max-in-flight"):
        scheduler(threshold=200, max_in_flight=100)


def test_direct_scheduler_reports_failures_only_through_the_task(tmp_path):
    registry = TaskChangelogRegistry()
    (tmp_path / JOB).write_bytes(b"blocks the job directory")
    up = StateChangeFsUploader(str(tmp_path), JOB, None, 1024, registry, ChangelogStorageMetricGroup())
    s = StateChangeUploadScheduler.direct_scheduler(up)
    sink = Sink()
    s.upload(sink.task(sealed(0, 0, [(0, b"a")])))  # does not raise
    assert len(sink.failures) == 1 and isinstance(sink.failures[0][1], OSError)
    assert s.get_availability_provider().is_available()
    s.close()
    registry.close()


def test_concurrent_uploads_all_settle(parts):
    scheduler, _, _ = parts
    s = scheduler(delay_ms=1, threshold=5000)
    sink = Sink()

    def run(k):
        for j in range(25):
            t = sink.task(sealed(k, j, [(j % 4, b"%d/%d" % (k, j))]))
            s.upload(t)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    wait_until(lambda: len(sink.results) == 100, T, "100 tasks")
    assert sink.failures == [] and s.in_flight_bytes() == 0
    seen = sorted((r.stream_handle.path, r.offset) for rs in sink.results for r in rs)
    assert len(set(seen)) == 100  # every change set at its own place


def test_a_failing_callback_does_not_block_the_rest_of_the_batch(parts):
    from dstl.changelog.upload.task import UploadTask

    scheduler, _, _ = parts
    s = scheduler(delay_ms=60_000)
    sink = Sink()

    def explode(results):
        raise RuntimeError("callback bug")

    s.upload(UploadTask([sealed(0, 0, [(0, b"a")])], explode, explode))
    s.upload(sink.task(sealed(1, 0, [(0, b"b")])))
    s.flush()
    wait_until(lambda: len(sink.results) == 1, T, "the second task")
    wait_until(lambda: s.in_flight_bytes() == 0, T, "capacity released for both tasks")
