"""Retries through the storage (thread mode) on the fault-injecting filesystem (docs/semantics.md §8)."""
from __future__ import annotations

import os
import time
import uuid

import pytest

from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
from faultyfs import faulty, faulty_url  # noqa: F401
from writer_modes import read_all, wait_until

T = 20
KGR = KeyGroupRange(0, 3)


@pytest.fixture
def storage_on_faulty(tmp_path, faulty):
    made = []

    def make(**options):
        job = uuid.uuid4().hex
        options.setdefault("batch_persist_delay", "0 ms")
        s = open_storage(faulty_url(tmp_path), upload_mode="thread", job_id=job, **options)
        made.append(s)
        return s, tmp_path / job / "dstl"

    yield make
    faulty.release_hangs()
    for s in made:
        s.close()


def _files(d):
    return sorted(os.listdir(d)) if d.exists() else []


def _persist(s, payload=b"p" * 500):
    w = s.create_writer("op", KGR)
    w.append_meta(b"m")
    w.append(1, payload)
    return w, w.persist(0, 1)


def _hist(s, name):
    return s.metrics[f"ChangelogStorage.{name}"]


def test_io_failures_are_retried_until_success(storage_on_faulty, faulty):
    s, d = storage_on_faulty(upload_max_attempts=3, upload_next_attempt_delay="10 ms", upload_timeout="0 ms")
    faulty.fail_writes(2)
    _, f = _persist(s)
    h = f.result(T).job_manager_owned_snapshot
    assert read_all(s, h) == [(-1, b"m"), (1, b"p" * 500)]
    assert len(_files(d)) == 1
    m = s.metrics
    assert m["ChangelogStorage.numberOfUploadRequests"] == 3
    assert m["ChangelogStorage.numberOfUploadFailures"] == 2
    assert _hist(s, "attemptsPerUpload")["max"] == 3
    assert _hist(s, "totalAttemptsPerUpload")["max"] == 3


def test_max_attempts_exhausted_fails_the_persist(storage_on_faulty, faulty):
    s, d = storage_on_faulty(upload_max_attempts=3, upload_next_attempt_delay="5 ms", upload_timeout="0 ms")
    faulty.fail_writes(3)
    w, f = _persist(s)
    with pytest.raises(OSError):
        f.result(T)
    assert _files(d) == []
    assert s.metrics["ChangelogStorage.numberOfUploadFailures"] == 3
    assert _hist(s, "attemptsPerUpload")["count"] == 0
    with pytest.raises(OSError, match="already failed"):
        w.persist(0, 2)


def test_delay_after_io_failure(storage_on_faulty, faulty):
    s, _ = storage_on_faulty(upload_max_attempts=2, upload_next_attempt_delay="300 ms", upload_timeout="0 ms")
    faulty.fail_writes(1)
    t0 = time.monotonic()
    _, f = _persist(s)
    f.result(T)
    assert time.monotonic() - t0 >= 0.3


def test_slow_attempt_gets_a_speculative_successor_and_the_loser_is_deleted(storage_on_faulty, faulty):
    s, d = storage_on_faulty(upload_max_attempts=3, upload_timeout="200 ms", upload_next_attempt_delay="10 ms")
    faulty.hang(15.0)  # the first attempt blocks in open until released
    t0 = time.monotonic()
    _, f = _persist(s)
    h = f.result(T).job_manager_owned_snapshot
    assert time.monotonic() - t0 < 10  # did not wait for the hanging attempt
    [winner] = _files(d)
    assert h.handles_and_offsets[0][0].path.endswith(winner)
    assert _hist(s, "attemptsPerUpload")["max"] == 2
    assert _hist(s, "totalAttemptsPerUpload")["max"] == 2
    faulty.release_hangs()  # the loser now writes its file, which must be discarded
    wait_until(lambda: s.metrics["ChangelogStorage.numberOfUploadRequests"] == 2 and _files(d) == [winner],
               T, "the losing attempt's file to be deleted")
    assert set(s.registry.tracked()) == {h.handles_and_offsets[0][0].path}
    assert read_all(s, h) == [(-1, b"m"), (1, b"p" * 500)]


def test_timeout_of_the_last_attempt_fails_even_if_it_succeeds_later(storage_on_faulty, faulty):
    s, d = storage_on_faulty(upload_max_attempts=1, upload_timeout="200 ms")
    faulty.hang(15.0)
    _, f = _persist(s)
    exc = f.exception(T)
    assert isinstance(exc, TimeoutError)
    faulty.release_hangs()
    time.sleep(0.2)
    wait_until(lambda: faulty.write_opens == 1 and _files(d) == [], T, "the late result to be discarded")
    assert s.registry.tracked() == {}


@pytest.mark.parametrize("fault", ["mid-write", "partial-close", "close"])
def test_failed_writes_leave_no_partial_file(storage_on_faulty, faulty, fault):
    s, d = storage_on_faulty(upload_max_attempts=2, upload_next_attempt_delay="5 ms", upload_timeout="0 ms")
    {"mid-write": lambda: faulty.fail_after_bytes(100),
     "partial-close": lambda: faulty.partial_then_fail_at_close(50),
     "close": lambda: faulty.fail_at_close()}[fault]()
    _, f = _persist(s, b"q" * 4000)
    h = f.result(T).job_manager_owned_snapshot
    [name] = _files(d)
    assert h.handles_and_offsets[0][0].path.endswith(name)
    assert read_all(s, h) == [(-1, b"m"), (1, b"q" * 4000)]
    assert s.metrics["ChangelogStorage.numberOfUploadFailures"] == 1


def test_policy_none_does_not_retry(storage_on_faulty, faulty):
    s, d = storage_on_faulty(upload_retry_policy="none")
    faulty.fail_writes(1)
    _, f = _persist(s)
    with pytest.raises(OSError):
        f.result(T)
    assert s.metrics["ChangelogStorage.numberOfUploadRequests"] == 1


def test_concurrent_writers_with_injected_faults_keep_the_model(tmp_path, faulty):
    """Failures, mid-write faults and slow attempts injected while 4 writers work: every persist still
    reads back exactly, losing attempts leave nothing behind, only confirmed files remain."""
    import threading

    from test_writer_stress import THRESHOLD, _writer_loop

    job = uuid.uuid4().hex
    s = open_storage(faulty_url(tmp_path), job_id=job, upload_mode="thread", preemptive_persist_threshold=THRESHOLD,
                     batch_persist_delay="2 ms", upload_max_attempts=6, upload_timeout="150 ms",
                     upload_next_attempt_delay="5 ms")
    stop = threading.Event()
    injected = []

    def inject():
        kinds = [lambda: faulty.fail_writes(1), lambda: faulty.fail_after_bytes(10),
                 lambda: faulty.hang(0.4), lambda: faulty.partial_then_fail_at_close(5)]
        i = 0
        while not stop.wait(0.02):
            if faulty.pending_write_faults() == 0:
                kinds[i % len(kinds)]()
                injected.append(i)
                i += 1

    confirmed, errors = set(), []
    injector = threading.Thread(target=inject)
    injector.start()
    try:
        threads = [threading.Thread(target=_writer_loop, args=(s, i, 200 + i, 15, confirmed, errors))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.set()
        injector.join(T)
        faulty.release_hangs()
        assert not any(t.is_alive() for t in threads)
        if errors:
            raise errors[0]
        assert faulty.failed_writes >= 1 and injected  # faults did fire
        s.close()  # waits for slow losing attempts; their files are deleted
        on_disk = set(os.listdir(tmp_path / job / "dstl"))
        assert on_disk == {os.path.basename(p) for p in confirmed}
        assert s.metrics["ChangelogStorage.numberOfUploadFailures"] > 0
    finally:
        stop.set()
        faulty.release_hangs()
        s.close()
