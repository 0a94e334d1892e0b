"""The figures a subtask measures for its batch's progress record (dstl.spark.progress): the state
rows it holds and what its storage uploaded during the batch, with Flink's metric names.

They travel in the task report's `metrics` JSON under the names below; the driver sums them."""
from __future__ import annotations

from typing import Any, Dict, Tuple

from dstl.metrics import PREFIX
from dstl.spark.processor_context import RESERVED_PREFIX

#: the state rows the subtask holds after the batch: keys of the user's states, dstl's own
#: (timers, TTL indexes) left out as Spark leaves out its internal column families
ROWS_TOTAL = "state_rows"
UPLOAD_REQUESTS = PREFIX + "numberOfUploadRequests"
UPLOAD_FAILURES = PREFIX + "numberOfUploadFailures"
#: bytes the batch's uploads carried (the sum of its `uploadSizes` values)
UPLOAD_BYTES = PREFIX + "uploadSizes.sum"
UPLOAD_LATENCY_MAX = PREFIX + "uploadLatenciesNanos.max"
ATTEMPTS_MAX = PREFIX + "totalAttemptsPerUpload.max"


def state_rows(backend: Any) -> int:
    """Keys held in the backend's states that are not dstl's own."""
    total = 0
    for name in backend.state_names:
        if not name.startswith(RESERVED_PREFIX):
            total += len(backend.get_state(name))
    return total


def upload_mark(storage: Any) -> Tuple[int, int, int, int, int]:
    """Where the storage's all-time counts stand now (upload_delta's starting point)."""
    g = storage.metric_group
    return (g.upload_requests.count, g.upload_failures.count, g.upload_sizes.count,
            g.upload_latencies_nanos.count, g.total_attempts_per_upload.count)


def _new_values(histogram: Any, before: int) -> list:
    """The values a histogram got since its count was `before` (as many as its window still holds)."""
    n = histogram.count - before
    values = histogram.values()
    return values[len(values) - min(n, len(values)):] if n > 0 else []


def upload_delta(storage: Any, mark: Tuple[int, int, int, int, int]) -> Dict[str, int]:
    """What the storage uploaded since `mark`, under the names above (zeros left out)."""
    g = storage.metric_group
    sizes = _new_values(g.upload_sizes, mark[2])
    latencies = _new_values(g.upload_latencies_nanos, mark[3])
    attempts = _new_values(g.total_attempts_per_upload, mark[4])
    figures = {UPLOAD_REQUESTS: g.upload_requests.count - mark[0],
               UPLOAD_FAILURES: g.upload_failures.count - mark[1],
               UPLOAD_BYTES: int(sum(sizes)),
               UPLOAD_LATENCY_MAX: int(max(latencies)) if latencies else 0,
               ATTEMPTS_MAX: int(max(attempts)) if attempts else 0}
    return {k: v for k, v in figures.items() if v}
