"""Metrics: counters, windowed histograms (Flink's percentile estimate), gauges, snapshot names."""
from __future__ import annotations

import threading

import pytest

from dstl.metrics import ChangelogStorageMetricGroup, Counter, Histogram

FLINK_NAMES = [
    "ChangelogStorage.numberOfUploadRequests", "ChangelogStorage.numberOfUploadFailures",
    "ChangelogStorage.uploadSizes", "ChangelogStorage.uploadLatenciesNanos",
    "ChangelogStorage.attemptsPerUpload", "ChangelogStorage.totalAttemptsPerUpload",
    "ChangelogStorage.uploadBatchSizes",
]


def test_counter_is_thread_safe():
    c = Counter()
    threads = [threading.Thread(target=lambda: [c.inc() for _ in range(10_000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.inc(5)
    assert c.count == 40_005


def test_histogram_window_keeps_last_1000_and_counts_all():
    h = Histogram()
    for v in range(1, 1501):
        h.update(v)
    s = h.snapshot()
    assert s["count"] == 1500
    assert s["min"] == 501 and s["max"] == 1500
    assert s["mean"] == pytest.approx(sum(range(501, 1501)) / 1000)
    assert h.values()[0] == 501 and len(h.values()) == 1000


def test_histogram_percentiles_follow_commons_math_legacy_estimation():
    h = Histogram()
    h.update_many([1, 2, 3, 4])
    s = h.snapshot()
    # pos = p*(n+1)/100: p50 -> 2.5 -> 2 + .5*(3-2)
    assert s["p50"] == 2.5
    assert s["p95"] == 4.0 and s["p99"] == 4.0  # pos >= n -> max
    h2 = Histogram()
    h2.update_many(range(1, 101))
    s2 = h2.snapshot()
    assert s2["p50"] == pytest.approx(50.5) and s2["p95"] == pytest.approx(95.95)
    assert s2["p99"] == pytest.approx(99.99)
    one = Histogram()
    one.update(7)
    assert one.snapshot() == {"count": 1, "min": 7, "max": 7, "mean": 7.0, "p50": 7.0, "p95": 7.0, "p99": 7.0}


def test_empty_histogram_snapshot():
    assert Histogram().snapshot() == {"count": 0, "min": 0, "max": 0, "mean": 0.0, "p50": 0.0,
                                      "p95": 0.0, "p99": 0.0}
    with pytest.raises(ValueError):
        Histogram(0)


def test_small_window():
    h = Histogram(window=3)
    h.update_many([10, 1, 2, 3])
    assert h.snapshot()["max"] == 3 and h.snapshot()["count"] == 4


def test_group_snapshot_names_and_types():
    m = ChangelogStorageMetricGroup()
    m.upload_requests.inc(5)
    m.upload_failures.inc()
    m.upload_sizes.update(49)
    m.upload_latencies_nanos.update(12345)
    m.attempts_per_upload.update(3)
    m.total_attempts_per_upload.update(4)
    m.upload_batch_sizes.update(5)
    queue = [1, 2, 3]
    m.register_gauge("uploadQueueSize", lambda: len(queue))
    m.register_gauge("inFlightBytes", lambda: 1024)
    m.register_gauge("availability", lambda: True)
    s = m.snapshot()
    assert list(s)[:7] == FLINK_NAMES
    assert s["ChangelogStorage.numberOfUploadRequests"] == 5
    assert s["ChangelogStorage.numberOfUploadFailures"] == 1
    assert s["ChangelogStorage.uploadSizes"]["min"] == 49
    assert s["ChangelogStorage.attemptsPerUpload"]["max"] == 3
    assert s["ChangelogStorage.totalAttemptsPerUpload"]["count"] == 1
    assert s["ChangelogStorage.uploadBatchSizes"]["mean"] == 5.0
    assert s["ChangelogStorage.uploadQueueSize"] == 3
    assert s["ChangelogStorage.inFlightBytes"] == 1024
    assert s["ChangelogStorage.availability"] == 1 and type(s["ChangelogStorage.availability"]) is int
    queue.clear()
    assert m.snapshot()["ChangelogStorage.uploadQueueSize"] == 0  # gauges are read at snapshot time


def test_gauge_errors():
    m = ChangelogStorageMetricGroup()
    with pytest.raises(ValueError):
        m.register_gauge("ChangelogStorage.uploadQueueSize", lambda: 0)
    with pytest.raises(TypeError):
        m.register_gauge("x", 5)

    def broken():
        raise RuntimeError("boom")

    m.register_gauge("broken", broken)
    m.register_gauge("ok", lambda: 2)
    s = m.snapshot()
    assert "ChangelogStorage.broken" not in s and s["ChangelogStorage.ok"] == 2
    m.unregister_gauge("ok")
    assert "ChangelogStorage.ok" not in m.snapshot()
