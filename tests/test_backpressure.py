"""Back-pressure: max-in-flight bytes, blocking writers, the availability provider (docs/semantics.md §7.3)."""
from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import CancelledError

import pytest

from conftest import heavy
from dstl.changelog.storage import open_storage
from dstl.types import KeyGroupRange
from dstl.changelog.upload.throttle import UploadThrottle
from faultyfs import faulty, faulty_url  # noqa: F401
from writer_modes import read_all, wait_until

T = 20
KGR = KeyGroupRange(0, 7)


@pytest.fixture
def throttled(tmp_path, faulty):
    s = open_storage(faulty_url(tmp_path), upload_mode="thread", job_id=uuid.uuid4().hex,
                     upload_max_in_flight=1000, batch_persist_size_threshold=100, batch_persist_delay="0 ms",
                     upload_timeout="0 ms", upload_num_threads=2)
    try:
        yield s
    finally:
        faulty.release_hangs()
        s.close()


def test_writer_blocks_above_max_in_flight_and_nothing_is_dropped(throttled, faulty):
    s = throttled
    avail = s.get_availability_provider()
    assert avail.is_available() and avail.future.done()
    faulty.hang(15.0)  # the first upload holds its 1200 bytes in flight
    a = s.create_writer("a", KGR)
    a.append(0, b"A" * 1200)  # one task may overshoot the limit
    fa = a.persist(0, 1)
    wait_until(lambda: s.metrics["ChangelogStorage.inFlightBytes"] == 1200, T, "in-flight bytes")
    assert not avail.is_available()
    assert s.metrics["ChangelogStorage.availability"] == 0
    waiting = avail.future
    assert not waiting.done()

    b = s.create_writer("b", KGR)
    b.append(1, b"B" * 10)
    returned = threading.Event()
    out = {}

    def persist_b():
        out["f"] = b.persist(0, 1)
        returned.set()

    t = threading.Thread(target=persist_b)
    t.start()
    wait_until(lambda: s.scheduler.waiting_callers == 1, T, "writer b to block")
    time.sleep(0.2)
    assert not returned.is_set()  # still blocked: no capacity
    assert not fa.done()

    faulty.release_hangs()
    assert returned.wait(T)
    t.join(T)
    ha = fa.result(T).job_manager_owned_snapshot
    hb = out["f"].result(T).job_manager_owned_snapshot
    assert waiting.result(T) is None  # completed when capacity returned
    assert read_all(s, ha) == [(0, b"A" * 1200)]
    assert read_all(s, hb) == [(1, b"B" * 10)]
    wait_until(lambda: s.metrics["ChangelogStorage.inFlightBytes"] == 0, T, "drain")
    assert s.metrics["ChangelogStorage.availability"] == 1


@heavy  # back-pressure logic, not a kernel: once
def test_preemptive_append_blocks_too(tmp_path, faulty):
    s = open_storage(faulty_url(tmp_path), upload_mode="thread", job_id=uuid.uuid4().hex,
                     upload_max_in_flight=100, batch_persist_size_threshold=50, batch_persist_delay="0 ms",
                     upload_timeout="0 ms", preemptive_persist_threshold=60)
    try:
        w = s.create_writer("w", KGR)
        faulty.hang(15.0)
        w.append(0, b"x" * 150)  # pre-emptive upload: 150 bytes in flight, hangs
        done = threading.Event()

        def more():
            w.append(1, b"y" * 70)  # second pre-emptive upload must wait for capacity
            done.set()

        t = threading.Thread(target=more)
        t.start()
        wait_until(lambda: s.scheduler.waiting_callers == 1, T, "append to block")
        assert not done.is_set()
        faulty.release_hangs()
        assert done.wait(T)
        t.join(T)
        h = w.persist(0, 1).result(T).job_manager_owned_snapshot
        assert read_all(s, h) == [(0, b"x" * 150), (1, b"y" * 70)]
    finally:
        faulty.release_hangs()
        s.close()


def test_close_cancels_waiting_callers(tmp_path, faulty):
    s = open_storage(faulty_url(tmp_path), upload_mode="thread", job_id=uuid.uuid4().hex,
                     upload_max_in_flight=100, batch_persist_size_threshold=100, batch_persist_delay="0 ms",
                     upload_timeout="0 ms")
    try:
        faulty.hang(15.0)
        a = s.create_writer("a", KGR)
        a.append(0, b"a" * 100)
        fa = a.persist(0, 1)
        b = s.create_writer("b", KGR)
        b.append(0, b"b")
        raised = {}

        def persist_b():
            try:
                b.persist(0, 1)
            except BaseException as e:  # inspected below
                raised["e"] = e

        t = threading.Thread(target=persist_b)
        t.start()
        wait_until(lambda: s.scheduler.waiting_callers == 1, T, "writer b to block")
        closer = threading.Thread(target=s.close)
        closer.start()
        t.join(T)
        assert isinstance(raised.get("e"), CancelledError)
        faulty.release_hangs()  # the running attempt finishes; close waits for it
        closer.join(T)
        assert not closer.is_alive()
        fa.result(T)  # the running upload still completed
    finally:
        faulty.release_hangs()
        s.close()


def test_throttle_accounting():
    th = UploadThrottle(10)
    th.acquire(4)
    assert th.availability.is_available()
    th.acquire(8)  # overshoot allowed for one caller
    assert th.in_flight == 12 and not th.availability.is_available()
    fut = th.availability.future
    assert not fut.done()
    th.release(4)  # 8 < 10: capacity is back
    assert fut.done() and th.availability.is_available()
    th.acquire(3)  # 11: unavailable again, with a fresh future
    assert not th.availability.is_available() and not th.availability.future.done()
    th.release(3)
    th.release(8)
    assert th.in_flight == 0 and th.availability.is_available()
    with pytest.raises(ValueError):
        UploadThrottle(0)
    th.close()
    with pytest.raises(CancelledError):
        th.acquire(1)
