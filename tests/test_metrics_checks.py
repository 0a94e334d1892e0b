"""The metric checks 1-6 of docs/options.md §4, through the public storage API."""
from __future__ import annotations

import uuid

import pytest

from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
from faultyfs import faulty, faulty_url  # noqa: F401

T = 20
KGR = KeyGroupRange(0, 9)
P = "ChangelogStorage."


@pytest.fixture
def storages():
    made = []

    def make(base, **options):
        s = open_storage(str(base), job_id=options.pop("job_id", uuid.uuid4().hex), **options)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("mode", ["direct", "thread"])
def test_1_five_persists_five_requests(tmp_path, storages, mode):
    s = storages(tmp_path, upload_mode=mode)
    w = s.create_writer("op", KGR)
    for i in range(5):
        w.append(i, b"x")
        w.persist(i, i).result(T)
    m = s.metrics
    assert m[P + "numberOfUploadRequests"] == 5
    assert m[P + "uploadLatenciesNanos"]["count"] == 5 and m[P + "uploadLatenciesNanos"]["min"] > 0
    assert m[P + "numberOfUploadFailures"] == 0


@pytest.mark.parametrize("mode", ["direct", "thread"])
def test_2_upload_size_is_the_logical_size(tmp_path, storages, mode):
    s = storages(tmp_path, upload_mode=mode)
    w = s.create_writer("op", KGR)
    w.append(1, b"y" * 33)
    w.persist(0, 1).result(T)
    sizes = s.metrics[P + "uploadSizes"]
    assert sizes["count"] == 1 and sizes["min"] == sizes["max"] == 49


def test_3_attempts_per_upload(tmp_path, storages, faulty):
    s = storages(faulty_url(tmp_path), upload_mode="thread", upload_max_attempts=3,
                 upload_next_attempt_delay="1 ms", upload_timeout="0 ms", batch_persist_delay="0 ms")
    faulty.fail_writes(2)
    w = s.create_writer("op", KGR)
    w.append(1, b"z")
    w.persist(0, 1).result(T)
    att = s.metrics[P + "attemptsPerUpload"]
    assert att["count"] == 1 and att["min"] == att["max"] == 3
    tot = s.metrics[P + "totalAttemptsPerUpload"]
    assert tot["min"] == tot["max"] == 3


def test_4_batch_size_of_five_writers(tmp_path, storages):
    s = storages(tmp_path, upload_mode="thread", batch_persist_delay="60 s")
    futures = []
    for i in range(5):
        w = s.create_writer(f"op{i}", KGR)
        w.append(i, b"b")
        futures.append(w.persist(0, 1))
    s.scheduler.flush()
    for f in futures:
        f.result(T)
    b = s.metrics[P + "uploadBatchSizes"]
    assert b["count"] == 1 and b["min"] == b["max"] == 5


def test_5_queue_size_gauge(tmp_path, storages):
    s = storages(tmp_path, upload_mode="thread", batch_persist_delay="60 s")
    futures = []
    for i in range(11):
        w = s.create_writer(f"op{i}", KGR)
        w.append(i % 10, b"q")
        futures.append(w.persist(0, 1))
    assert s.metrics[P + "uploadQueueSize"] == 11
    assert s.metrics[P + "inFlightBytes"] == 11
    s.scheduler.flush()
    assert s.metrics[P + "uploadQueueSize"] == 0
    for f in futures:
        f.result(T)
    assert s.metrics[P + "inFlightBytes"] == 0 and s.metrics[P + "availability"] == 1


@pytest.mark.parametrize("policy,expected", [("none", 5), ("fixed", 15)])
def test_6_failures_count_every_attempt(tmp_path, storages, policy, expected):
    job = uuid.uuid4().hex
    (tmp_path / job).write_bytes(b"the job directory cannot be created")
    s = storages(tmp_path, job_id=job, upload_mode="thread", upload_retry_policy=policy,
                 upload_max_attempts=3, upload_next_attempt_delay="1 ms", upload_timeout="0 ms")
    for i in range(5):
        w = s.create_writer(f"op{i}", KGR)
        w.append(i, b"f")
        with pytest.raises(OSError):
            w.persist(0, 1).result(T)
    m = s.metrics
    assert m[P + "numberOfUploadFailures"] == expected
    assert m[P + "numberOfUploadRequests"] == expected
    assert m[P + "uploadBatchSizes"]["count"] == 5


@pytest.mark.parametrize("mode", ["direct", "thread"])
def test_gauges_are_always_present(tmp_path, storages, mode):
    m = storages(tmp_path, upload_mode=mode).metrics
    for name in ("uploadQueueSize", "inFlightBytes", "availability"):
        assert isinstance(m[P + name], int)
    assert m[P + "availability"] == 1
