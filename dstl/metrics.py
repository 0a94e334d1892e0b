"""Flink's `ChangelogStorageMetricGroup` (docs/options.md §4): counters, windowed histograms, gauges."""
from __future__ import annotations

import logging
import math
import threading
from collections import deque
from typing import Callable, Dict, Iterable, Union

log = logging.getLogger(__name__)

PREFIX = "ChangelogStorage."

Number = Union[int, float]


class Counter:
    """A thread-safe monotone counter."""

    __slots__ = ("_count", "_lock")

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def inc(self, n: int = 1) -> None:
        with self._lock:
            self._count += n

    @property
    def count(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"Counter({self._count})"


def _percentile(ordered: list, p: float) -> float:
    """Commons-math `Percentile` (legacy estimation), which Flink's histogram statistics use."""
    n = len(ordered)
    pos = p * (n + 1) / 100.0
    if pos < 1:
        return float(ordered[0])
    if pos >= n:
        return float(ordered[-1])
    lower = ordered[int(math.floor(pos)) - 1]
    upper = ordered[int(math.floor(pos))]
    return float(lower + (pos - math.floor(pos)) * (upper - lower))


class Histogram:
    """Keeps the last `window` values (Flink: DescriptiveStatisticsHistogram); `count` is all-time."""

    def __init__(self, window: int = 1000):
        if window < 1:
            raise ValueError(f"histogram window must be >= 1, got {window}")
        self._values: deque = deque(maxlen=window)
        self._count = 0
        self._lock = threading.Lock()

    def update(self, value: Number) -> None:
        with self._lock:
            self._values.append(value)
            self._count += 1

    def update_many(self, values: Iterable[Number]) -> None:
        with self._lock:
            for v in values:
                self._values.append(v)
                self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def values(self) -> list:
        """The values in the window, oldest first."""
        with self._lock:
            return list(self._values)

    def snapshot(self) -> Dict[str, Number]:
        """`{count, min, max, mean, p50, p95, p99}` over the window; zeros while empty."""
        with self._lock:
            ordered = sorted(self._values)
            count = self._count
        if not ordered:
            return {"count": count, "min": 0, "max": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
        return {
            "count": count,
            "min": ordered[0],
            "max": ordered[-1],
            "mean": sum(ordered) / len(ordered),
            "p50": _percentile(ordered, 50),
            "p95": _percentile(ordered, 95),
            "p99": _percentile(ordered, 99),
        }

    def __repr__(self) -> str:
        return f"Histogram(count={self._count})"


class ChangelogStorageMetricGroup:
    """The metrics of one storage; `snapshot()` gives `"ChangelogStorage.<name>"` -> value."""

    def __init__(self, window: int = 1000):
        self.upload_requests = Counter()
        self.upload_failures = Counter()
        self.upload_sizes = Histogram(window)
        self.upload_latencies_nanos = Histogram(window)
        self.attempts_per_upload = Histogram(window)
        self.total_attempts_per_upload = Histogram(window)
        self.upload_batch_sizes = Histogram(window)
        self._gauges: Dict[str, Callable[[], int]] = {}
        self._lock = threading.Lock()

    # Flink's metric names, in Flink's order
    _COUNTERS = (("numberOfUploadRequests", "upload_requests"), ("numberOfUploadFailures", "upload_failures"))
    _HISTOGRAMS = (
        ("uploadSizes", "upload_sizes"),
        ("uploadLatenciesNanos", "upload_latencies_nanos"),
        ("attemptsPerUpload", "attempts_per_upload"),
        ("totalAttemptsPerUpload", "total_attempts_per_upload"),
        ("uploadBatchSizes", "upload_batch_sizes"),
    )

    def register_gauge(self, name_suffix: str, fn: Callable[[], int]) -> None:
        """Register (or replace) a gauge such as "uploadQueueSize", "inFlightBytes", "availability"."""
        if not isinstance(name_suffix, str) or not name_suffix or name_suffix.startswith(PREFIX):
            raise ValueError(f"gauge name must be a bare metric name like 'uploadQueueSize', got {name_suffix!r}")
        if not callable(fn):
            raise TypeError(f"gauge {name_suffix!r} needs a callable, got {type(fn).__name__}")
        with self._lock:
            self._gauges[name_suffix] = fn

    def unregister_gauge(self, name_suffix: str) -> None:
        with self._lock:
            self._gauges.pop(name_suffix, None)

    def snapshot(self) -> Dict[str, object]:
        """Counters and gauges as ints, histograms as dicts; a failing gauge is logged and left out."""
        out: Dict[str, object] = {}
        for name, attr in self._COUNTERS:
            out[PREFIX + name] = getattr(self, attr).count
        for name, attr in self._HISTOGRAMS:
            out[PREFIX + name] = getattr(self, attr).snapshot()
        with self._lock:
            gauges = list(self._gauges.items())
        for name, fn in gauges:
            try:
                out[PREFIX + name] = int(fn())
            except Exception:  # a gauge must never break a metrics snapshot
                log.exception("gauge %s failed", name)
        return out


__all__ = ["Counter", "Histogram", "ChangelogStorageMetricGroup", "PREFIX"]
