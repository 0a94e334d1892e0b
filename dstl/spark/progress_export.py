"""Progress records (dstl.spark.progress) exported to Prometheus or OpenTelemetry, each under the
names its ecosystem expects. Both are listeners: ``stream.add_listener(PrometheusExporter())``.

Nothing is started here: the Prometheus exporter fills a registry (prometheus_client's default one,
or the user's) that the user's own HTTP server or push gateway exposes; the OpenTelemetry one uses
the API's meter, a no-op until the application configures an SDK. Extras: ``dstl[prometheus]``,
``dstl[otel]``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from dstl.spark import task_figures as F

__all__ = ["PrometheusExporter", "OpenTelemetryExporter", "COUNTERS", "GAUGES"]

#: (metric, what, where in the record's state operator): sums per batch, exported as counters
COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("dstl_input_rows", "rows the processor was given", "customMetrics.dstlRowsIn"),
    ("dstl_output_rows", "rows the processor emitted", "customMetrics.dstlRowsOut"),
    ("dstl_late_rows_dropped", "rows dropped as later than the watermark", "numRowsDroppedByWatermark"),
    ("dstl_timers_expired", "timers that fired", "customMetrics.numExpiredTimers"),
    ("dstl_subtask_moves", "subtasks that ran on another executor than in the batch before",
     "customMetrics.dstlSubtasksMoved"),
    ("dstl_changelog_storage_upload_requests", "changelog upload requests (Flink: numberOfUploadRequests)",
     "customMetrics." + F.UPLOAD_REQUESTS),
    ("dstl_changelog_storage_upload_failures", "failed changelog uploads (Flink: numberOfUploadFailures)",
     "customMetrics." + F.UPLOAD_FAILURES),
    ("dstl_changelog_storage_uploaded_bytes", "bytes the changelog uploads carried",
     "customMetrics." + F.UPLOAD_BYTES),
)
#: (metric, what, where, scale to base units): the latest batch's value
GAUGES: Tuple[Tuple[str, str, str, float], ...] = (
    ("dstl_state_rows", "state rows held (dstl's own timers and TTL indexes not counted)", "numRowsTotal", 1),
    ("dstl_state_checkpointed_bytes", "bytes of state in the checkpoint (materialized and changelog)",
     "customMetrics.dstlStateSizeBytes", 1),
    ("dstl_state_store_instances", "subtasks that ran the batch", "numStateStoreInstances", 1),
    ("dstl_subtasks_warm", "subtasks that continued from memory", "customMetrics.dstlSubtasksWarm", 1),
    ("dstl_subtasks_restored", "subtasks that restored their state from a checkpoint",
     "customMetrics.dstlSubtasksRestored", 1),
    ("dstl_restore_duration_seconds", "the slowest restore of the batch", "customMetrics.dstlRestoreLatencyMsMax",
     1e-3),
    ("dstl_commit_duration_seconds", "time spent committing the batch's state", "commitTimeMs", 1e-3),
    ("dstl_update_duration_seconds", "time the subtasks spent processing rows (summed)", "allUpdatesTimeMs", 1e-3),
)


def _value(operator: Dict[str, Any], where: str) -> Optional[float]:
    node: Any = operator
    if where.startswith("customMetrics."):
        node, where = node.get("customMetrics", {}), where[len("customMetrics."):]
    value = node.get(where)
    return None if value is None or value < 0 else float(value)


class PrometheusExporter:
    """A progress listener that updates prometheus_client metrics (snake_case names, base units,
    `_total` counters), labelled by ``query`` (the query's name, else its id) and ``operator``."""

    def __init__(self, registry: Any = None, namespace: str = ""):
        try:
            import prometheus_client as prom  # optional: the `prometheus` extra
        except ImportError as exc:
            raise ImportError("PrometheusExporter needs prometheus_client: pip install 'dstl[prometheus]'") from exc
        registry = prom.REGISTRY if registry is None else registry
        labels = ("query", "operator")
        prefix = f"{namespace}_" if namespace else ""
        self._counters = {name: prom.Counter(prefix + name, what, labels, registry=registry)
                          for name, what, _ in COUNTERS}
        self._gauges = {name: prom.Gauge(prefix + name, what, labels, registry=registry)
                        for name, what, _, _ in GAUGES}
        self._batch = prom.Histogram(prefix + "dstl_batch_duration_seconds", "a batch's time in dstl", labels,
                                     registry=registry)

    def __call__(self, record: Dict[str, Any]) -> None:
        query = record.get("name") or record.get("id") or ""
        for op in record.get("stateOperators", []):
            labels = (query, op.get("operatorName", ""))
            for name, _, where in COUNTERS:
                value = _value(op, where)
                if value:
                    self._counters[name].labels(*labels).inc(value)
            for name, _, where, scale in GAUGES:
                value = _value(op, where)
                if value is not None:
                    self._gauges[name].labels(*labels).set(value * scale)
            seconds = record.get("durationMs", {}).get("dstlBatch")
            if seconds is not None:
                self._batch.labels(*labels).observe(seconds / 1e3)


class OpenTelemetryExporter:
    """A progress listener that records OpenTelemetry instruments (dotted names, UCUM units) on the
    API's meter ``dstl``; attributes ``spark.query.name``/``spark.query.id`` and ``dstl.operator``."""

    def __init__(self, meter: Any = None):
        try:
            from opentelemetry import metrics  # optional: the `otel` extra
        except ImportError as exc:
            raise ImportError("OpenTelemetryExporter needs opentelemetry-api: pip install 'dstl[otel]'") from exc
        meter = meter if meter is not None else metrics.get_meter("dstl")
        self._counters = {name: meter.create_counter(_otel_name(name), unit="{row}" if "rows" in name else "1",
                                                     description=what) for name, what, _ in COUNTERS}
        self._gauges = {name: meter.create_gauge(_otel_name(name), unit="s" if name.endswith("_seconds") else "1",
                                                 description=what) for name, what, _, _ in GAUGES}
        self._batch = meter.create_histogram("dstl.batch.duration", unit="s", description="a batch's time in dstl")

    def __call__(self, record: Dict[str, Any]) -> None:
        for op in record.get("stateOperators", []):
            attrs = {"spark.query.id": record.get("id") or "", "spark.query.name": record.get("name") or "",
                     "dstl.operator": op.get("operatorName", "")}
            for name, _, where in COUNTERS:
                value = _value(op, where)
                if value:
                    self._counters[name].add(value, attrs)
            for name, _, where, scale in GAUGES:
                value = _value(op, where)
                if value is not None:
                    self._gauges[name].set(value * scale, attrs)
            ms = record.get("durationMs", {}).get("dstlBatch")
            if ms is not None:
                self._batch.record(ms / 1e3, attrs)


def _otel_name(name: str) -> str:
    """dstl_state_rows -> dstl.state.rows; the unit suffix goes into the instrument's unit instead."""
    base = name[:-len("_seconds")] if name.endswith("_seconds") else name
    return "dstl." + base[len("dstl_"):].replace("_", ".")
